#!/usr/bin/env bash
# Create a kind cluster for Fulcrum's end-to-end tests.
#
# Usage: e2e/kind/create-cluster.sh [--gpu] [--name NAME]
#   --gpu   a GPU variant: the node gets the host's NVIDIA GPUs through the NVIDIA container runtime (the host
#           needs the NVIDIA driver and nvidia-container-toolkit with `accept-nvidia-visible-devices-as-volume-mounts
#           = true`), then the NVIDIA device plugin is installed so pods can request nvidia.com/gpu.
#   --name  cluster name (default fulcrum-e2e; env KIND_CLUSTER_NAME).
# Idempotent: an existing cluster of that name is reused.
set -euo pipefail
NAME="${KIND_CLUSTER_NAME:-fulcrum-e2e}"
GPU=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --gpu) GPU=1; shift ;;
        --name) NAME="$2"; shift 2 ;;
        *) echo "create-cluster: unknown argument $1" >&2; exit 2 ;;
    esac
done
for tool in docker kind kubectl; do
    command -v "$tool" >/dev/null || { echo "create-cluster: $tool not found (e2e/README.md lists the prerequisites)" >&2; exit 1; }
done
if kind get clusters 2>/dev/null | grep -qx "$NAME"; then
    echo "create-cluster: reusing kind cluster $NAME"
else
    CONFIG="$(mktemp)"
    trap 'rm -f "$CONFIG"' EXIT
    {
        echo "kind: Cluster"
        echo "apiVersion: kind.x-k8s.io/v1alpha4"
        echo "nodes:"
        echo "  - role: control-plane"
        echo "    image: kindest/node:v1.30.13"
        if [[ "$GPU" == "1" ]]; then
            # the NVIDIA runtime injects every GPU when this file is mounted (volume-mount device list strategy)
            echo "    extraMounts:"
            echo "      - hostPath: /dev/null"
            echo "        containerPath: /var/run/nvidia-container-devices/all"
        fi
    } > "$CONFIG"
    kind create cluster --name "$NAME" --config "$CONFIG" --wait 120s
fi
kubectl config use-context "kind-$NAME" >/dev/null
if [[ "$GPU" == "1" ]]; then
    kubectl apply -f https://raw.githubusercontent.com/NVIDIA/k8s-device-plugin/v0.17.0/deployments/static/nvidia-device-plugin.yml
    kubectl -n kube-system rollout status daemonset/nvidia-device-plugin-daemonset --timeout=180s
    echo "create-cluster: GPUs on the node: $(kubectl get nodes -o jsonpath='{.items[0].status.allocatable.nvidia\.com/gpu}')"
fi
echo "create-cluster: kind-$NAME ready"
