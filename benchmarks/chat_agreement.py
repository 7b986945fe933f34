"""Agreement of `agentrl eval --engine chat` (against `agentrl serve`) with `--engine hf`, greedy, default policy.

Runs, in one go: `agentrl serve --model default`; `agentrl eval --env ENV --engine chat --base-url … --model
default --set chat.token_ids=true` on the first `--tasks` problems; `agentrl eval --env ENV --model default` (the hf
engine, in process) on the same problems; then compares, episode by episode, every turn's generated token ids
(the chat reply's `token_ids`, the hf trajectory's generated spans) and the verdicts (return, success).

Prints one JSON object: episodes compared, how many have identical token ids and identical verdicts (the goal:
all), the first mismatches, both pass@1, and the chat run's token usage. Run: `python benchmarks/chat_agreement.py
--tasks 50` (about two minutes on 2 cores, bwrap sandboxes, env workers in process).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

AGENTRL = [sys.executable, "-m", "agentrl"]
COMMON = ["--set", "env_workers=local", "--set", "sandbox.backend=bwrap"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--env", default="code_sandbox")
    ap.add_argument("--tasks", type=int, default=50)
    ap.add_argument("--turns", type=int, default=1, help="attempts per problem, with the env's feedback between them")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="chat-agreement-"))
    server = subprocess.Popen(
        [*AGENTRL, "serve", "--model", "default", "--port", "0"], stdout=subprocess.PIPE, text=True
    )
    try:
        url = next(line.split()[-1] for line in server.stdout if "http://" in line)
        base = ["eval", "--env", args.env, "--tasks", str(args.tasks), "--turns", str(args.turns), *COMMON]
        chat = [
            *base,
            "--engine",
            "chat",
            "--base-url",
            f"{url}/v1",
            "--model",
            "default",
            "--set",
            "chat.token_ids=true",
        ]
        subprocess.run([*AGENTRL, *chat, "--out", str(tmp / "chat")], check=True, capture_output=True)
    finally:
        server.terminate()
        server.wait(60)
    subprocess.run([*AGENTRL, *base, "--model", "default", "--out", str(tmp / "hf")], check=True, capture_output=True)

    hf = {}
    for line in (tmp / "hf" / "trajectories" / "eval.jsonl").read_text().splitlines():
        t = json.loads(line)
        if "token_ids" in t:
            spans = [t["token_ids"][turn["start"] : turn["end"]] for turn in t["turns"]]
            success = t["terminated"] and bool(t["turns"]) and t["turns"][-1]["info"].get("outcome") == 1.0
            hf[t["task_id"]] = (spans, t["outcome_reward"], success)
    same_ids = same_verdicts = 0
    mismatches = []
    rows = [json.loads(line) for line in (tmp / "chat" / "results.jsonl").read_text().splitlines()]
    for row in rows:
        episode = row["episodes"][0]
        spans, ret, success = hf[row["task_id"]]
        ids_ok = [turn["token_ids"] for turn in episode["turns"]] == spans
        verdict_ok = (episode["outcome"], episode["success"]) == (ret, success)
        same_ids += ids_ok
        same_verdicts += verdict_ok
        if not (ids_ok and verdict_ok) and len(mismatches) < 5:
            mismatches.append({"task": row["task_id"], "token_ids": ids_ok, "verdict": verdict_ok})
    summaries = {k: json.loads((tmp / k / "summary.json").read_text()) for k in ("chat", "hf")}
    print(
        json.dumps(
            {
                "env": args.env,
                "turns_allowed": args.turns,
                "episodes": len(rows),
                "turns": sum(len(r["episodes"][0]["turns"]) for r in rows),
                "identical_token_ids": same_ids,
                "identical_verdicts": same_verdicts,
                "agreement": same_ids / len(rows) if rows else None,
                "mismatches": mismatches,
                "pass_at_k": {k: s["pass_at_k"] for k, s in summaries.items()},
                "chat_usage": summaries["chat"]["usage"],
                "wall_s": {k: round(s["wall_s"], 1) for k, s in summaries.items()},
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
