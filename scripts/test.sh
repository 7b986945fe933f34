#!/usr/bin/env bash
# README command 2: the whole test suite, against a real Docker engine: lint, the fast tier with coverage
# (every module of agentrl must run a line), then the slow tier.
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
.venv/bin/lint-imports

# The fast tier (every test not marked slow), measuring which lines of agentrl it runs in the test processes
# (not in `agentrl` subprocesses or Ray actors); then the slow tier. Both on 2 pytest-xdist workers, a test file
# to a worker (its module fixtures start once): the tests wait on containers, Ray and subprocesses, and one
# process at a time left a core idle about 40% of the time. The multi-node Ray cluster tests run last, alone:
# their node-loss timings are what a second worker's load would disturb.
mkdir -p test-artifacts
export COVERAGE_FILE=test-artifacts/.coverage
xdist=(-n 2 --dist loadfile --no-loadscope-reorder)  # files longest first: tests/conftest.py's LONGEST
.venv/bin/pytest -q -p no:cacheprovider --durations=25 "${xdist[@]}" -m "not slow" --cov=agentrl --cov-report=term "$@"
# every module of agentrl (bar __init__.py) ran at least one line in the fast tier
.venv/bin/python - <<'CHECK'
import os
import sys
from pathlib import Path

import coverage

data = coverage.CoverageData(basename=os.environ["COVERAGE_FILE"])
data.read()
ran = {Path(f).resolve() for f in data.measured_files() if data.lines(f)}
modules = sorted(p for p in Path("agentrl").rglob("*.py") if p.name != "__init__.py")
idle = [str(p) for p in modules if p.resolve() not in ran]
print(f"coverage check: {len(modules) - len(idle)} of {len(modules)} modules of agentrl ran in the fast tier")
if idle:
    sys.exit("coverage check: no line of these ran in the fast tier: " + ", ".join(idle))
CHECK
.venv/bin/pytest -q -p no:cacheprovider --durations=25 "${xdist[@]}" -m slow --ignore=tests/cluster "$@"
.venv/bin/pytest -q -p no:cacheprovider --durations=25 -m slow tests/cluster "$@"
