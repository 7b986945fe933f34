#!/usr/bin/env bash
# Make repo_fix's starting policy (configs/repo_fix.yaml), offline, after bash scripts/setup.sh, in two SFT stages:
#   1. the scripted expert's demonstrations through the real repo_fix env and Docker sandboxes, on the training
#      templates' training instances, erring at repository skills (configs/sft/repo_fix.yaml says how), and
#      agentrl sft of the embedded default policy (which already calls tools) on them (about 3.5 h on 2 cores, 4 min
#      on one H100: agentrl sft trains on the GPU when there is one);
#   2. demonstrations of the same expert that also misspells the module's name 3 times in 10 and recovers from
#      every error (views the right module, makes the exact edit), its erring calls written with weight 0 so that
#      they are context and not targets, and one epoch on them (3,000: about 25 min here): the policy learns to go
#      on after its own errors without learning to make them (BENCHMARKS.md, repo_fix: 43% held out against 37%
#      for recovering 3 times in 10 with the errors trained).
# Usage: bash scripts/build_repo_policy.sh [WORK_DIR [N_DEMOS [TASKS [START]]]]   (writes WORK_DIR/demos*.jsonl,
# WORK_DIR/sft and WORK_DIR/policy). START: what stage 1 fine-tunes, "default" (the embedded default policy) or an
# `agentrl models init` preset made at random init in WORK_DIR/init ("small": 14.4M parameters). TASKS: the task
# set the demonstrations come from; by default half of the training instances, each in 9 spellings of its names (one
# bug shown under many paths and names, so that only reading them off the observations fits: docs/design.md), the
# recipe's RL samples the other half (configs/repo_fix.yaml). Run again
# after an interruption, it keeps the demonstrations already written and each SFT stage continues from its last save
# (configs/sft/repo_fix.yaml).
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-build/repo}
n=${2:-1000}
tasks=${3:-repos:part=1/2;spellings=9}
start=${4:-default}
mkdir -p "$work"
agentrl=.venv/bin/agentrl
demos() {  # demos OUT ARGS...: max_turns as the recipe has it; OUT appears once complete
  [ -s "$1" ] && return
  $agentrl envs demos repo_fix -n "$n" --wrong-file 0.3 --sloppy-edit 0.3 --concurrency 4 --set max_turns=8 \
    --set "tasks=$tasks" --out "$1.part" "${@:2}"
  mv "$1.part" "$1"
}
sft() {  # sft OUT ARGS...: agentrl_sft.json is the last file a finished run writes
  [ -s "$1/agentrl_sft.json" ] && return
  $agentrl sft --config configs/sft/repo_fix.yaml --out "$1" "${@:2}"
}
demos "$work/demos.jsonl" --seed 1
if [ "$start" != default ]; then
  [ -s "$work/init/config.json" ] || $agentrl models init "$work/init" --preset "$start"
  start=$work/init
fi
sft "$work/sft" --data "$work/demos.jsonl" --model "$start"
demos "$work/demos_recover.jsonl" --typo-path 0.3 --recover 1.0 --mask-errors --seed 2
sft "$work/policy" --data "$work/demos_recover.jsonl" --model "$work/sft" --set epochs=1 --set lr=3.0e-4
