"""`agentrl view` stays light: the run-folder layer and the viewer import no torch, transformers or ray,
and decode token ids with the `tokenizers` library exactly as the run's transformers tokenizer does."""

import json
import subprocess
import sys

from agentrl.engine.base import Generation, SamplingParams
from agentrl.models.tokenizer import load_tokenizer
from agentrl.rollout import Status, Trajectory
from agentrl.runs import RunDir, TrainedView, write_trajectories

# What the `agentrl view` process runs: the CLI's modules, the app, and a request of every kind (one renders
# a trajectory, which loads the tokenizer). It prints which heavy libraries ended up in sys.modules.
PROBE = """
import json, sys
import agentrl.cli
from fastapi.testclient import TestClient
from agentrl.view.server import create_app
client = TestClient(create_app(sys.argv[1]), base_url="http://127.0.0.1")
for path in ("/", "/api/overview", "/api/metrics", "/api/facets", "/api/trajectories", "/api/trajectory/e0",
             "/api/group/g0"):
    assert client.get(path).status_code == 200, path
shown = client.get("/api/trajectory/e0").json()
heavy = sorted(m for m in ("torch", "transformers", "ray", "agentrl.train", "agentrl.rollout") if m in sys.modules)
print(json.dumps({"heavy": heavy, "trajectory": shown}))
"""


def _folder(tmp_path):
    tok = load_tokenizer("qwen3")
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Write a function. é ✓"}], tokenize=False, add_generation_prompt=True
    )
    prompt = tok.encode(text, add_special_tokens=False)
    t = Trajectory(episode_id="e0", group_id="g0", task_id="t0", sampling=SamplingParams())
    t.append_prompt(list(prompt))
    reply = tok.encode("def f(x):\n    return x * 2  # ünïcode<|im_end|>", add_special_tokens=False)
    t.append_generation(Generation(reply, [-0.5] * len(reply), [3] * len(reply), "stop"))
    t.append_observation(tok.encode("<|im_start|>user\nok ✓<|im_end|>\n", add_special_tokens=False))
    t.status, t.terminated, t.outcome_reward = Status.FINISHED, True, 1.0
    run = RunDir(tmp_path / "run")
    run.create({"model": {"path": "default"}})
    tok.save_pretrained(run.tokenizer)
    n = len(t.token_ids)
    view = TrainedView(advantages=[0.5] * n, trainer_logprobs=[-0.25] * n, ratio=1.0, clipped=0.0, minibatch=0)
    write_trajectories(run.trajectories, "iter-00000.jsonl", [t], 0, {"e0": view})
    return run, t, tok


def test_the_viewer_imports_no_torch_transformers_or_ray(tmp_path):
    run, t, tok = _folder(tmp_path)
    out = subprocess.run([sys.executable, "-c", PROBE, str(run.path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    probe = json.loads(out.stdout.splitlines()[-1])
    assert probe["heavy"] == [], f"agentrl view imported {probe['heavy']}"
    # the text the page shows is transformers' decoding of the same ids, token by token and whole
    shown = probe["trajectory"]
    turn = t.turns[0]
    assert shown["turns"][0]["tokens"] == [tok.decode([i]) for i in t.token_ids[turn.start : turn.end]]
    assert shown["prompt"] == tok.decode(t.token_ids[: turn.start])
    assert shown["turns"][0]["observation"] == tok.decode(t.token_ids[turn.end :])
    assert shown["turns"][0]["version"] == [3] * (turn.end - turn.start)
    assert shown["trained"] == {"ratio": 1.0, "clipped": 0.0, "minibatch": 0}
