#!/usr/bin/env bash
# Every CUDA path of agentrl in one command, written as one JSON report (the checks: benchmarks/gpu_check.py).
#
#   bash scripts/gpu_check.sh [--out gpu_check.json]   # on a GPU machine
#   bash scripts/gpu_check.sh --cpu-dry-run            # the same code paths on the CPU, shrunk
#
# Exit status 1 if any check failed (a skipped one does not fail). Python: .venv/bin/python if there is one,
# else python3; the checkout is importable without being installed.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="$root/.venv/bin/python"
[ -x "$python" ] || python=python3
exec "$python" "$root/benchmarks/gpu_check.py" "$@"
