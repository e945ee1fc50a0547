#!/usr/bin/env bash
# Build the Fulcrum image, load it into the kind cluster, install a bare Prometheus and the chart.
#
# Usage: e2e/kind/install.sh [--name NAME] [--worker-image IMAGE]
#   --worker-image  also load this (already built) worker image, e.g. fulcrum-worker:e2e for the GPU test.
# Environment: FULCRUM_IMAGE (default fulcrum:e2e), FULCRUM_SKIP_BUILD=1 to load an image built earlier,
#              NAMESPACE (default fulcrum-system).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
NAME="${KIND_CLUSTER_NAME:-fulcrum-e2e}"
IMAGE="${FULCRUM_IMAGE:-fulcrum:e2e}"
NAMESPACE="${NAMESPACE:-fulcrum-system}"
WORKER_IMAGE=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --name) NAME="$2"; shift 2 ;;
        --worker-image) WORKER_IMAGE="$2"; shift 2 ;;
        *) echo "install: unknown argument $1" >&2; exit 2 ;;
    esac
done
for tool in docker kind kubectl helm; do
    command -v "$tool" >/dev/null || { echo "install: $tool not found (e2e/README.md lists the prerequisites)" >&2; exit 1; }
done
kubectl config use-context "kind-$NAME" >/dev/null
if [[ "${FULCRUM_SKIP_BUILD:-0}" != "1" ]]; then
    docker build -t "$IMAGE" "$REPO"
fi
kind load docker-image --name "$NAME" "$IMAGE"
if [[ -n "$WORKER_IMAGE" ]]; then
    kind load docker-image --name "$NAME" "$WORKER_IMAGE"
fi
# a plain Prometheus scraping the operator and the pods it creates (same relabelling as the chart's PodMonitor)
kubectl create namespace monitoring --dry-run=client -o yaml | kubectl apply -f -
kubectl -n monitoring create configmap fulcrum-alerts --from-file=alerts.yaml="$REPO/dashboards/alerts.yaml" --dry-run=client -o yaml | kubectl apply -f -
kubectl apply -f "$REPO/e2e/kind/prometheus.yaml"
kubectl -n monitoring rollout status deployment/prometheus --timeout=180s
"$REPO/scripts/sync-chart-crd.sh" --check
helm upgrade --install fulcrum "$REPO/charts/fulcrum" \
    --namespace "$NAMESPACE" --create-namespace --wait --timeout 5m \
    --set image.repository="${IMAGE%:*}" --set image.tag="${IMAGE##*:}" --set image.pullPolicy=Never \
    --set operator.prometheusUrl=http://prometheus.monitoring.svc:9090 \
    --set operator.logFormat=text \
    --set etcd.enabled=true --set nats.enabled=true
kubectl -n "$NAMESPACE" rollout status deployment/fulcrum-operator --timeout=180s
echo "install: fulcrum installed in $NAMESPACE (image $IMAGE)"
