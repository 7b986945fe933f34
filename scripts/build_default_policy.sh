#!/usr/bin/env bash
# Rebuild the embedded default policy (agentrl/models/assets/default_policy) from scratch, offline:
#   1. demonstrations: the procedural tasks' reference solutions, written by an imperfect expert
#      with a habit: 7 times in 10 it prints the function's result instead of returning it. Played
#      through the real code_sandbox env and Docker sandboxes (about 10 min for 15000 on 2 cores);
#   2. a random-init Qwen3-MoE of the default shapes with the project tokenizer;
#   3. agentrl sft on the demonstrations (configs/sft/default_policy.yaml; 80 min on 2 cores, measured with other work beside it).
# Usage: bash scripts/build_default_policy.sh [WORK_DIR [OUT_DIR [MODELS_INIT_OPTION ...]]]   (after bash scripts/setup.sh)
#   e.g. the stability study's 8-expert top-2 policy, made like the default:
#   bash scripts/build_default_policy.sh build/moe8 build/moe8/policy --experts 8 --top-k 2
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-build/default_policy}
out=${2:-agentrl/models/assets/default_policy}
shift $(($# < 2 ? $# : 2))
mkdir -p "$work"
agentrl=.venv/bin/agentrl
# the default recipe's task set: demonstrations and training see the same tasks (their train split)
tasks=$(.venv/bin/python -c "import yaml; print(yaml.safe_load(open('configs/code_sandbox.yaml'))['rollout']['env_kwargs']['tasks'])")
$agentrl envs demos code_sandbox -n 15000 --prints 0.7 --seed 1 --set "tasks=$tasks" --out "$work/demos.jsonl"
$agentrl models init "$work/init" --preset default --seed 0 "$@"
$agentrl sft --config configs/sft/default_policy.yaml --data "$work/demos.jsonl" --model "$work/init" --out "$out"
