#!/usr/bin/env bash
# Bring a Debian machine with Python 3.11 to a working agentrl, idempotently:
# system packages, a running Docker engine, .venv with agentrl[dev], the sandbox image (and its root for bwrap).
set -euo pipefail
cd "$(dirname "$0")/.."

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

need=()
command -v dockerd >/dev/null || need+=(docker.io)
command -v debootstrap >/dev/null || need+=(debootstrap)  # offline sandbox base image
command -v bwrap >/dev/null || need+=(bubblewrap)  # sandboxes without a daemon (sandbox.backend=bwrap)
command -v pgrep >/dev/null || need+=(procps)
python3 -c "import ensurepip, venv" 2>/dev/null || need+=(python3-venv)
if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing ${need[*]}"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

if ! docker info >/dev/null 2>&1; then
  echo "setup: starting dockerd (log: /var/log/agentrl-dockerd.log)"
  as_root sh -c 'nohup dockerd >/var/log/agentrl-dockerd.log 2>&1 &'
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { echo "setup: dockerd did not start; see /var/log/agentrl-dockerd.log"; exit 1; }
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
# torch is pinned to 2.13.0 in pyproject.toml so a CPU machine takes its CPU wheel.
.venv/bin/pip install -q --disable-pip-version-check -e ".[dev]" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import agentrl" # the install above must have worked

.venv/bin/agentrl sandbox build
