"""Does `agentrl view` stay responsive on a big run? Its API timed on 10,000 saved trajectories against
100 (the baseline, same run, same machine), with the server's resident memory.

Both folders hold copies of one synthetic trajectory of the default shape (a prompt, 3 turns of
generated tokens and observations, with its `trained` view), written by the run's own writer
(`write_trajectories`), 100 per iteration. The server is the real `agentrl view` (a subprocess).
Prints one JSON object:

    python benchmarks/view_bench.py            # ~1 min
"""

from __future__ import annotations

import json
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness
import httpx
import yaml

from agentrl.engine.base import Generation, SamplingParams
from agentrl.rollout import Status, Trajectory
from agentrl.runs import TrainedView, write_trajectories


def trajectory(rng: random.Random) -> tuple[Trajectory, TrainedView]:
    t = Trajectory(episode_id="x", group_id="g", task_id="procedural/lists/2/1", sampling=SamplingParams())
    t.append_prompt([rng.randrange(2000) for _ in range(700)])
    for turn in range(3):
        n = 80
        t.append_generation(
            Generation(
                token_ids=[rng.randrange(2000) for _ in range(n)],
                logprobs=[-rng.random() for _ in range(n)],
                versions=[turn] * n,
                finish_reason="stop",
            )
        )
        t.turns[-1].reward = rng.choice([0.0, 0.1])
        if turn < 2:
            t.append_observation([rng.randrange(2000) for _ in range(60)])
    t.status, t.terminated = Status.FINISHED, True
    L = len(t.token_ids)
    view = TrainedView(
        advantages=[round(rng.gauss(0, 1), 4) for _ in range(L)],
        trainer_logprobs=[round(-rng.random(), 4) for _ in range(L)],
        ratio=1.0,
        clipped=0.0,
        minibatch=0,
    )
    return t, view


def build(folder: Path, n: int) -> None:
    rng = random.Random(0)
    base, view = trajectory(rng)
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump({"model": {"path": "default"}}))
    (folder / "metrics.jsonl").write_text(
        "".join(json.dumps({"iteration": i, "rollout/reward": rng.random()}) + "\n" for i in range(max(1, n // 100)))
    )
    for it in range(max(1, n // 100)):
        copies = [
            base.model_copy(update={"episode_id": f"{it:05d}-{k:03d}", "group_id": f"{it}-{k // 8}"})
            for k in range(min(100, n))
        ]
        write_trajectories(
            folder / "trajectories", f"iter-{it:05d}.jsonl", copies, it, {c.episode_id: view for c in copies}
        )


def timed(client: httpx.Client, url: str, repeats: int = 20) -> float:
    """Median seconds of a GET (after one warm-up)."""
    client.get(url).raise_for_status()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        client.get(url).raise_for_status()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(folder: Path, last_id: str) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentrl", "view", str(folder), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            for _ in range(300):
                try:
                    c.get("/api/overview").raise_for_status()
                    break
                except httpx.HTTPError:
                    time.sleep(0.2)
            t0 = time.perf_counter()
            c.get("/api/trajectories?limit=50").raise_for_status()  # the first call reads the index
            first = time.perf_counter() - t0
            out = {
                "first_list_s": round(first, 4),
                "list_page_s": round(timed(c, "/api/trajectories?limit=50&offset=100"), 4),
                "filtered_page_s": round(timed(c, "/api/trajectories?limit=50&min_reward=0.1&turns=3"), 4),
                "trajectory_s": round(timed(c, f"/api/trajectory/{last_id}"), 4),
                "page_html_s": round(timed(c, "/"), 4),
            }
        out["server_rss_mb"] = harness.tree_rss_mib(proc.pid)
        out["data_mb"] = round(sum(p.stat().st_size for p in (folder / "trajectories").iterdir()) / 2**20, 1)
        return out
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        small, big = Path(tmp) / "small", Path(tmp) / "big"
        build(small, 100)
        build(big, 10_000)
        base, many = measure(small, "00000-099"), measure(big, "00099-099")
    print(
        json.dumps(
            {
                "baseline_100": base,
                "trajectories_10000": many,
                "ratio_10000_over_100": {k: round(many[k] / base[k], 2) for k in base if base[k]},
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
