#!/usr/bin/env bash
# README command 1: a fresh Debian machine to agentrl's main job.
# Until training lands, that job is running an example program in a sandbox.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/agentrl sandbox exec examples/hello.py
