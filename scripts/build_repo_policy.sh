#!/usr/bin/env bash
# Make repo_fix's starting policy (configs/repo_fix.yaml), offline, after bash scripts/setup.sh:
#   1. demonstrations: the scripted expert through the real repo_fix env and Docker sandboxes, on the training
#      templates' training instances, erring at repository skills (configs/sft/repo_fix.yaml says how);
#   2. agentrl sft of the embedded default policy (which already calls tools) on them.
# Usage: bash scripts/build_repo_policy.sh [WORK_DIR [N_DEMOS]]   (writes WORK_DIR/demos.jsonl and WORK_DIR/policy)
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-build/repo}
n=${2:-2000}
mkdir -p "$work"
agentrl=.venv/bin/agentrl
$agentrl envs demos repo_fix -n "$n" --wrong-file 0.3 --sloppy-edit 0.3 --seed 1 --concurrency 4 \
  --set max_turns=8 --out "$work/demos.jsonl"  # max_turns as the recipe has it
$agentrl sft --config configs/sft/repo_fix.yaml --data "$work/demos.jsonl" --model default --out "$work/policy"
