# syntax=docker/dockerfile:1
# Fulcrum control-plane image: `fulcrum operator`, `fulcrum router`, `fulcrum sim-worker` (and every other
# subcommand). The operator's --image names this image for the router and sim-worker pods. Build from the root:
#   docker build -t ghcr.io/OWNER/fulcrum:0.1.0 .
# Engine pods (real vLLM) use worker-image/Dockerfile (GPU) or worker-image/Dockerfile.cpu instead.

ARG PYTHON_IMAGE=python:3.11.7-slim-bookworm
FROM ${PYTHON_IMAGE}

ARG FULCRUM_UID=10001

COPY . /tmp/fulcrum-src

# One environment, pinned by the lockfile (the build backend too: pip passes PIP_CONSTRAINT to its isolated
# build environment).
RUN PIP_CONSTRAINT=/tmp/fulcrum-src/worker-image/constraints.txt \
        python -m pip install --no-cache-dir "/tmp/fulcrum-src[operator,worker]" \
    && rm -rf /tmp/fulcrum-src

RUN groupadd --gid "${FULCRUM_UID}" fulcrum \
    && useradd --uid "${FULCRUM_UID}" --gid "${FULCRUM_UID}" --create-home --home-dir /home/fulcrum fulcrum

# FULCRUM_HEALTH_URL: what the image's HEALTHCHECK polls. 8000/health fits the router and sim-worker; set it to
# http://127.0.0.1:8080/healthz for the operator (kopf's liveness endpoint). Kubernetes uses its own probes.
ENV PYTHONUNBUFFERED=1 \
    FULCRUM_HEALTH_URL=http://127.0.0.1:8000/health

# 8000: router / sim-worker HTTP; 8080: operator liveness (/healthz); 9090: operator metrics.
EXPOSE 8000 8080 9090

USER ${FULCRUM_UID}:${FULCRUM_UID}
WORKDIR /home/fulcrum

HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ['FULCRUM_HEALTH_URL'], timeout=4)"]

ENTRYPOINT ["fulcrum"]
CMD ["--help"]
