#!/usr/bin/env bash
# README command 1: a fresh Debian machine to a finished default training run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/agentrl train --env code_sandbox --build-image
