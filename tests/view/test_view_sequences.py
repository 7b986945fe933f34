"""Trajectories of several token sequences (a re-rendered, folded or rewritten context) and GiGPO step groups in
`agentrl view`: a synthetic saved folder (a word-level tokenizer of its own: no model is loaded), read by `Folder`,
served by the app, and drawn by headless Chromium (the app in a thread of this process). Also what the viewer does
when the folder breaks or changes under it: a trajectory file gone or garbled (a run folder still being copied off a
cluster, a disk error), a metrics line the writer finishes after the page read it torn, a slow page left loading."""

import json
import shutil
import socket
import threading
import time

import pytest
import uvicorn
from fastapi.testclient import TestClient
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from agentrl.engine.base import Generation, SamplingParams
from agentrl.rollout.trajectory import SequenceReason, Status, Trajectory
from agentrl.runs import RunDir, TrainedView, summary, write_trajectories
from agentrl.view import Filters, Folder, create_app

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FOLD_INFO = {"policy": "truncate", "dropped_turns": [0]}


def words(*ids: int) -> str:
    return " ".join(f"w{i}" for i in ids)


def _turn(t: Trajectory, ids: list[int], state: str | None, reply: list[int] | None = None) -> None:
    t.append_generation(Generation(ids, [-0.5] * len(ids), [1] * len(ids), "stop"))
    t.turns[-1].state_key = state
    if reply:
        t.append_observation(reply)


def _trajectories() -> tuple[Trajectory, Trajectory, Trajectory]:
    """g0: `multi` (3 sequences: a rerender, then a fold) and `peer` (1 sequence, back in its first state once);
    g1: `far`, in the same state as g0's first turns (another group: not in their step group)."""
    multi = Trajectory(episode_id="multi", group_id="g0", task_id="t0", sampling=SamplingParams())
    multi.append_prompt([0, 1, 2, 3, 4])
    _turn(multi, [10, 11, 12], "s-start", reply=[20, 21])
    multi.start_sequence([30, 31, 32, 33, 34, 35], SequenceReason.RERENDER)
    _turn(multi, [13, 14], "s-mid", reply=[22, 23])
    multi.start_sequence([40, 41, 42, 43], SequenceReason.FOLD, FOLD_INFO)
    _turn(multi, [15, 16, 17], "s-end")
    peer = Trajectory(episode_id="peer", group_id="g0", task_id="t0", sampling=SamplingParams())
    peer.append_prompt([0, 1, 2, 3, 4])
    _turn(peer, [10, 18], "s-start", reply=[24])
    _turn(peer, [19], "s-start")
    far = Trajectory(episode_id="far", group_id="g1", task_id="t1", sampling=SamplingParams())
    far.append_prompt([5, 6])
    _turn(far, [10], "s-start")
    for t in (multi, peer, far):
        t.status, t.terminated, t.outcome_reward = Status.FINISHED, True, 1.0
    return multi, peer, far


def _trained(t: Trajectory, ratios: list[float] | None = None) -> TrainedView:
    n = len(t.token_ids)
    return TrainedView(
        advantages=[0.5] * n, trainer_logprobs=[-0.25] * n, ratio=1.0, clipped=0.0, minibatch=0, sequence_ratios=ratios
    )


def _old_line(folder, name: str) -> None:
    """A trajectory as a run saved it before sequences and state keys existed: no "sequences" key in its line or
    its index line, no "state_key" in its turns, no "sequence_ratios" in its trained view."""
    t = Trajectory(episode_id="old", group_id="g2", task_id="t2", sampling=SamplingParams())
    t.append_prompt([7, 8])
    _turn(t, [10, 11], None, reply=[25])
    t.status, t.terminated = Status.FINISHED, True
    trained = _trained(t).model_dump()
    del trained["sequence_ratios"]
    row = {"iteration": 1, **t.model_dump(mode="json"), "trained": trained}
    del row["sequences"]
    for turn in row["turns"]:
        del turn["state_key"]
    line = json.dumps(row) + "\n"
    entry = summary(row) | {"file": name, "offset": 0, "length": len(line.encode())}
    del entry["sequences"]
    (folder / name).write_text(line)
    with open(folder / "index.jsonl", "a") as f:
        f.write(json.dumps(entry) + "\n")


@pytest.fixture
def run(tmp_path) -> RunDir:
    run = RunDir(tmp_path / "run")
    run.create({"model": {"path": "default"}})
    run.tokenizer.mkdir(parents=True)
    Tokenizer(WordLevel({f"w{i}": i for i in range(50)}, unk_token="w49")).save(str(run.tokenizer / "tokenizer.json"))
    multi, peer, far = _trajectories()
    views = {"multi": _trained(multi, [1.0, 0.9, 1.1]), "peer": _trained(peer)}
    write_trajectories(run.trajectories, "iter-00000.jsonl", [multi, peer, far], 0, views)
    _old_line(run.trajectories, "iter-00001.jsonl")
    return run


def test_a_trajectory_of_three_sequences_is_shown_sequence_by_sequence(run):
    folder = Folder(run.path)
    shown = folder.trajectory("multi")
    assert shown["summary"]["sequences"] == 3
    seqs = shown["sequences"]
    assert [(s["index"], s["start"], s["end"], s["prompt"], s["reason"]) for s in seqs] == [
        (0, 0, 10, 5, None),
        (1, 10, 20, 6, "rerender"),
        (2, 20, 27, 4, "fold"),
    ]
    assert [s["info"] for s in seqs] == [{}, {}, FOLD_INFO]
    assert [s["ratio"] for s in seqs] == [1.0, 0.9, 1.1]
    assert [s["generated"] for s in seqs] == [3, 2, 3] and [s["tokens"] for s in seqs] == [10, 10, 7]
    assert [s["turns"] for s in seqs] == [[0], [1], [2]]
    # a later sequence's prompt is context apart from the turns; the first's is the trajectory's prompt
    assert shown["prompt"] == words(0, 1, 2, 3, 4) and seqs[0]["context"] is None
    assert seqs[1]["context"] == words(30, 31, 32, 33, 34, 35) and seqs[2]["context"] == words(40, 41, 42, 43)
    assert all(s["lead"] == "" for s in seqs)
    turns = shown["turns"]
    assert [t["sequence"] for t in turns] == [0, 1, 2]
    assert [t["tokens"] for t in turns] == [["w10", "w11", "w12"], ["w13", "w14"], ["w15", "w16", "w17"]]
    # a reply stops where the next sequence starts: it never shows the re-rendered prompt as the env's
    assert [t["observation"] for t in turns] == [words(20, 21), words(22, 23), ""]
    assert shown["trained"] == {"ratio": 1.0, "clipped": 0.0, "minibatch": 0}


def test_one_sequence_and_an_old_format_line_still_open(run):
    folder = Folder(run.path)
    peer = folder.trajectory("peer")
    assert [(s["start"], s["end"], s["prompt"], s["reason"], s["ratio"]) for s in peer["sequences"]] == [
        (0, 9, 5, None, None)
    ]
    assert [t["sequence"] for t in peer["turns"]] == [0, 0] and peer["turns"][0]["observation"] == words(24)
    old = folder.trajectory("old")
    assert old["summary"]["sequences"] == 1, "an index line without the count reads as one sequence"
    assert [(s["start"], s["end"], s["prompt"], s["context"]) for s in old["sequences"]] == [(0, 5, 2, None)]
    assert old["prompt"] == words(7, 8) and old["turns"][0]["observation"] == words(25)
    assert old["turns"][0]["state_key"] is None and old["turns"][0]["step_group"] is None


def test_the_list_counts_sequences_and_filters_on_several(run):
    assert summary(json.loads((run.trajectories / "iter-00000.jsonl").read_text().splitlines()[0]))["sequences"] == 3
    folder = Folder(run.path)
    counts = {r["episode_id"]: r["sequences"] for r in folder.trajectories(Filters())["items"]}
    assert counts == {"multi": 3, "peer": 1, "far": 1, "old": 1}
    assert [r["episode_id"] for r in folder.trajectories(Filters(multi=True))["items"]] == ["multi"]
    assert {r["episode_id"] for r in folder.trajectories(Filters(multi=False))["items"]} == {"peer", "far", "old"}
    client = TestClient(create_app(run.path), base_url="http://127.0.0.1")
    page = client.get("/api/trajectories", params={"multi": "true"}).json()
    assert page["matching"] == 1 and page["items"][0]["sequences"] == 3
    assert client.get("/api/trajectories", params={"multi": "false", "iteration": 1}).json()["matching"] == 1
    shown = client.get("/api/trajectory/multi").json()
    assert [(s["start"], s["reason"]) for s in shown["sequences"]] == [(0, None), (10, "rerender"), (20, "fold")]


def test_the_viewer_answers_loopback_names_alone(run):
    """`agentrl view` has no key: a web page this machine's browser opens could reach it under a DNS name that
    resolves to 127.0.0.1 (rebinding) and read the run, unless the Host it names is refused."""
    app = create_app(run.path)
    assert TestClient(app, base_url="http://localhost:8765").get("/api/overview").status_code == 200
    rebound = TestClient(app, base_url="http://attacker.example:8765").get("/api/overview")
    assert (rebound.status_code, rebound.text) == (400, "Invalid host header")


def test_step_groups_count_the_turns_of_a_state_among_the_groups_saved_trajectories(run):
    folder = Folder(run.path)
    multi = folder.trajectory("multi")["turns"]
    assert [t["state_key"] for t in multi] == ["s-start", "s-mid", "s-end"]
    # s-start: multi's turn 0 and both of peer's (far holds it too, in another group: not counted)
    assert multi[0]["step_group"] == {
        "size": 3,
        "trajectories": 2,
        "saved": 2,
        "members": [["multi", 0], ["peer", 0], ["peer", 1]],
    }
    assert multi[1]["step_group"] == {"size": 1, "trajectories": 1, "saved": 2, "members": [["multi", 1]]}
    peer = folder.trajectory("peer")["turns"]
    assert [t["step_group"]["size"] for t in peer] == [3, 3]
    assert folder.trajectory("far")["turns"][0]["step_group"]["size"] == 1
    # the side-by-side group view carries them too
    assert [t["turns"][0]["step_group"]["size"] for t in folder.group("g0", 0)["members"]] == [3, 3]


class _App:
    """The viewer's app served by uvicorn in a thread of this process (the subprocess `agentrl view` of
    tests/view/test_view.py costs seconds to start)."""

    def __init__(self, folder) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(folder), port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "_App":
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the viewer did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.mark.slow  # a browser, as the other page tests
def test_the_page_shows_sequences_and_step_groups(run):
    if CHROMIUM is None:
        pytest.fail("no chromium on PATH: bash scripts/test.sh installs Debian's")
    from playwright.sync_api import sync_playwright

    with _App(run.path) as app, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page()
        page.goto(app.url + "/#/trajectories")
        page.wait_for_selector("#trajectories tr.row")
        assert page.inner_text("tr.row[data-episode='multi'] td.seqs") == "3"
        assert page.inner_text("tr.row[data-episode='peer'] td.seqs") == "1"
        page.select_option("select[name=multi]", "true")
        page.click("form.filters button")
        page.wait_for_function("document.querySelector('#count').textContent.includes('of 1 matching')")
        assert page.locator("#trajectories tr.row").count() == 1

        page.click("tr.row[data-episode='multi']")
        page.wait_for_selector(".sequence")
        heads = page.eval_on_selector_all(".sequence > .seq-head", "hs => hs.map(h => h.textContent)")
        assert heads == [
            "sequence 1 of 3 — the episode's start · 10 tokens (3 generated) · prompt 5 tokens · s_i 1.0000",
            "sequence 2 of 3 — rerender · 10 tokens (2 generated) · prompt 6 tokens · s_i 0.9000",
            "sequence 3 of 3 — fold (policy=truncate, dropped_turns=[0]) · 7 tokens (3 generated) · prompt 4 tokens"
            " · s_i 1.1000",
        ]
        assert page.eval_on_selector_all(".sequence", "ss => ss.map(s => s.querySelectorAll('.turn').length)") == [
            1,
            1,
            1,
        ]
        # later prompts: collapsed context, never tokens of a turn
        assert page.eval_on_selector_all("details.context", "ds => ds.map(d => d.open)") == [False, False]
        assert page.eval_on_selector_all("pre.context", "ps => ps.map(p => p.textContent)") == [
            words(30, 31, 32, 33, 34, 35),
            words(40, 41, 42, 43),
        ]
        assert page.locator(".tok").count() == 8, "only the generated tokens are tokens"
        assert page.inner_text("#sequences") == "sequences 3 (rerender, fold)"
        assert "(mean of 3 sequences)" in page.inner_text("#ratio")
        groups = page.eval_on_selector_all(".stepgroup", "ss => ss.map(s => s.textContent)")
        assert groups[0] == (
            " · state s-start · step group: 3 turns among saved (in 2 of 2 saved trajectories of the group)"
        )
        assert groups[1].startswith(" · state s-mid · step group: 1 turn among saved")

        page.goto(app.url + "/#/t/old")  # one sequence, no states: as before sequences existed
        page.wait_for_function("document.querySelector('h2').textContent === 'Trajectory old'")
        assert page.locator(".sequence").count() == 0 and page.locator(".stepgroup").count() == 0
        assert page.locator("details.context").count() == 0 and page.locator(".tok").count() == 2
        page.goto(app.url + "/#/g/g0/0")
        page.wait_for_selector("#group .sample")
        assert page.locator("#group .sample[data-episode='multi'] .sequence").count() == 3
        assert page.locator("#group .sample[data-episode='peer'] .sequence").count() == 0
        browser.close()


def _span(run, episode_id: str) -> dict:
    rows = [json.loads(line) for line in (run.trajectories / "index.jsonl").read_text().splitlines()]
    return next(r for r in rows if r["episode_id"] == episode_id)


def test_a_listed_trajectory_whose_data_is_gone_or_garbled_is_said_not_a_500(run):
    (run.trajectories / "iter-00001.jsonl").unlink()  # "old"'s file: not there (yet, or any more)
    peer = _span(run, "peer")
    with open(run.trajectories / peer["file"], "r+b") as f:  # "peer"'s line garbled in place
        f.seek(peer["offset"] + 10)
        f.write(b"\xff\x00garbage")
    client = TestClient(create_app(run.path), base_url="http://127.0.0.1")
    gone = client.get("/api/trajectory/old")
    assert gone.status_code == 410 and "in iter-00001.jsonl, which is not there" in gone.json()["detail"]
    garbled = client.get("/api/trajectory/peer")
    assert garbled.status_code == 410
    assert (
        f"its line in iter-00000.jsonl (byte {peer['offset']}, {peer['length']} bytes) is unreadable"
        in (garbled.json()["detail"])
    )
    # the group shows what is readable and names the rest
    group = client.get("/api/group/g0", params={"iteration": 0})
    assert group.status_code == 200
    assert [t["episode_id"] for t in group.json()["members"]] == ["multi"]
    assert len(group.json()["warnings"]) == 1 and "trajectory peer:" in group.json()["warnings"][0]
    assert client.get("/api/trajectory/nosuch").status_code == 404


@pytest.mark.slow  # a browser, as the other page tests
def test_a_warning_goes_once_its_line_is_whole_and_a_page_left_loading_stays_away(run):
    if CHROMIUM is None:
        pytest.fail("no chromium on PATH: bash scripts/test.sh installs Debian's")
    from playwright.sync_api import sync_playwright

    with open(run.metrics, "w") as f:
        f.write('{"iteration": 0, "rollout/reward": 0.25}\n{"iteration": 1, "rollout/rew')  # mid-write
    with _App(run.path) as app, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page()
        # the group's answer comes 1.5 s late, as a group of long trajectories does
        page.add_init_script("""
            const fetched = window.fetch;
            window.fetch = (url, ...rest) => String(url).includes('/api/group/')
                ? new Promise((r) => setTimeout(r, 1500)).then(() => fetched(url, ...rest))
                    .then((answer) => { setTimeout(() => { window.groupAnswered = true; }, 200); return answer; })
                : fetched(url, ...rest);
        """)
        page.goto(app.url + "/")
        page.wait_for_selector("#warnings:not([hidden])")
        assert "last line is incomplete" in page.inner_text("#warnings")
        with open(run.metrics, "a") as f:  # the writer finishes its line: the warning was about a moment
            f.write('ard": 0.5}\n')
        page.wait_for_selector("#warnings", state="hidden", timeout=10_000)

        page.evaluate("location.hash = '#/g/g0/0'")
        page.evaluate("location.hash = '#/trajectories'")  # left before the group loaded
        page.wait_for_selector("#trajectories tr.row")
        page.wait_for_function("window.groupAnswered === true")
        assert page.evaluate("location.hash") == "#/trajectories"
        assert page.inner_text("#main h2") == "Trajectories" and page.locator("#group").count() == 0
        browser.close()
