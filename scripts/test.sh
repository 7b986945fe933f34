#!/usr/bin/env bash
# README command 2: the whole test suite, against a real Docker engine.
# Starts what it needs; stops the engine afterwards if it was the one to start it.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! docker info >/dev/null 2>&1; then
  stop_engine() {
    pid=$(cat /var/run/docker.pid 2>/dev/null || true)
    [ -n "$pid" ] || return 0
    kill "$pid" 2>/dev/null || sudo kill "$pid" || true
    for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || return 0; sleep 1; done
  }
  trap stop_engine EXIT
fi
bash scripts/setup.sh
# the `agentrl view` tests drive a headless browser: Debian's chromium
if ! command -v chromium >/dev/null; then
  echo "test: installing chromium"
  as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/pytest -q -p no:cacheprovider "$@"
