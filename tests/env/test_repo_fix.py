"""repo_fix against real sandboxes: the tools, SWE-bench-style grading, the scripted expert, and hostile agents, each
followed by an honest episode in the same (recycled) sandbox. What keeps the hidden tests secret and contains a
hostile agent runs on Docker and on bwrap; the rest of the env is the same code on either, and runs on Docker."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import random
import shutil
from pathlib import Path

import docker
import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

import agentrl
from agentrl.env import FailureClass, SandboxSource
from agentrl.env.demos import play
from agentrl.envs.repo_fix import closest_lines, expert_edits, misquote
from agentrl.models.tokenizer import load_tokenizer
from agentrl.rollout import ChatFormat
from agentrl.sandbox import (
    BwrapSandbox,
    BwrapSandboxConfig,
    DockerSandbox,
    SandboxConfig,
    SandboxError,
    SandboxPool,
    reaper,
)
from agentrl.tasks.repos import HIDDEN_TESTS, apply_patch
from agentrl.tasks.solutions import Expert

TASK = "repo-inifile-3"  # the hex parser: a missing case in values.py, FAIL_TO_PASS in the hidden tests only


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


DOCKER = pytest.param("docker", marks=pytest.mark.docker)
ON_DOCKER = pytest.mark.parametrize("reused", [DOCKER], indirect=True)
"""for a test of the env's own code, the same on any backend"""


def backend_factory(backend: str):
    """Starts one sandbox of `backend`: Docker's default, or bwrap's on the host's /usr (no Docker needed)."""
    if backend == "docker":
        return DockerSandbox.create
    return functools.partial(BwrapSandbox.create, BwrapSandboxConfig(rootfs="host"))


@pytest.mark.docker
@pytest.mark.slow
def test_gymnasium_check_env(sandbox_image):
    env = gymnasium.make("agentrl/repo_fix-v0")
    check_env(env.unwrapped, skip_render_check=True)
    env.close()


@pytest.fixture(params=[DOCKER, "bwrap"])
async def reused(request):
    """One warm sandbox of the backend, recycled between episodes: the next episode gets the one this one used.
    Grading sandboxes are the same backend's."""
    request.getfixturevalue("sandbox_image" if request.param == "docker" else "bwrap_site")
    factory = backend_factory(request.param)
    pool = SandboxPool(factory, size=1, reuse=100)
    yield SandboxSource(pool, factory=factory, sandbox=SandboxConfig(backend=request.param))
    await pool.close()


async def expert_episode(env, task_id: str = TASK) -> tuple[float, dict, str]:
    """The scripted expert on `task_id`: (return, last info, the workspace sandbox's name)."""
    await env.areset(options={"task_id": task_id})
    name = (await env.sandbox()).name
    total = 0.0
    for action in env.demonstration(env.task, random.Random(0)):
        _, reward, term, trunc, info = await env.astep(action)
        total += reward
        assert info["failure"] is not FailureClass.INFRA, info.get("error")
        if term or trunc:
            return total, info, name
    raise AssertionError("the expert did not end the episode")


async def test_the_expert_fixes_the_issue_and_its_diff_is_the_gold_patch(reused):
    env = agentrl.make("repo_fix", sandboxes=reused)
    reward, info, _ = await expert_episode(env)
    inst = env.repo_tasks.instance(TASK)
    assert reward == 1.0 and info["resolved"] and info["outcome"] == 1.0 and not info["autosubmitted"]
    assert info["diff"] == inst.patch and info["changed_files"] == ["inifile/values.py"] and info["left_out"] == {}
    assert info["tests_passed"] == info["tests_total"] == len(inst.FAIL_TO_PASS)
    await env.aclose()


@pytest.mark.slow  # the fast tier is at its budget; the perfect expert's episode covers the code
@ON_DOCKER
async def test_the_imperfect_expert_gives_up_after_its_error_or_recovers_from_it(reused):
    """wrong_file: a view of another module, then a submission of no change; sloppy_edit: an edit that fails,
    then the same; typo_path: a view of the right module misspelt, whose error names it. With recover=1 it goes
    on after the error (the right view, the exact edit) and resolves; with mask_errors the erring calls are
    recorded with weight 0, so that SFT trains on the recovery only."""
    env = agentrl.make("repo_fix", sandboxes=reused)
    chat = ChatFormat(load_tokenizer("qwen3"))
    path = expert_edits(env.repo_tasks.instance(TASK))[0][0]
    for expert, resolved, calls in [
        (Expert(wrong_file=1.0), False, [("view", "ok"), ("submit", "ok")]),
        (Expert(sloppy_edit=1.0), False, [("view", "ok"), ("edit", "error"), ("submit", "ok")]),
        (Expert(typo_path=1.0), False, [("view", "error"), ("submit", "ok")]),
        (Expert(wrong_file=1.0, recover=1.0), True, [("view", "ok"), ("view", "ok"), ("edit", "ok")]),
        (Expert(sloppy_edit=1.0, recover=1.0), True, [("view", "ok"), ("edit", "error"), ("edit", "ok")]),
        (Expert(typo_path=1.0, recover=1.0, mask_errors=True), True, [("view", "error"), ("view", "ok")]),
        (Expert(sloppy_edit=1.0, recover=1.0, mask_errors=True), True, [("view", "ok"), ("edit", "error")]),
    ]:
        demo = await play(env, TASK, env.demonstration(env.task_set.get(TASK), random.Random(0), expert=expert))
        said = [m for m in demo.messages if m["role"] == "assistant"]
        made = [c for m in said for c in env.parser.parse(m["content"]).calls]
        assert [c.name for c in made][: len(calls)] == [t for t, _ in calls], (expert, made)
        assert (demo.episode_return == 1.0) is resolved, (expert, demo.episode_return)
        views = [c.arguments["path"] for c in made if c.name == "view"]
        assert (views[0] != path) is bool(expert.wrong_file or expert.typo_path), (expert, views)
        assert (views[-1] == path) is (resolved or not (expert.wrong_file or expert.typo_path)), (expert, views)
        if expert.typo_path:  # the error names the module meant
            assert f"did you mean {path}?" in demo.messages[demo.messages.index(said[0]) + 1]["content"]
        erring = [i for i, (_, status) in enumerate(calls) if status == "error"]
        assert [m.get("weight", 1) for m in said] == [
            0 if expert.mask_errors and i in erring else 1 for i in range(len(said))
        ], (expert, said)
        if expert.mask_errors:  # the erring call is context, not a target
            ids, mask = chat.conversation_ids(demo.messages, tools=demo.tools)
            trained = chat.tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
            assert said[erring[0]]["content"] not in trained and said[erring[0] + 1]["content"] in trained
    await env.aclose()


@pytest.mark.slow
@ON_DOCKER
async def test_the_expert_solves_one_instance_of_every_family(reused):
    env = agentrl.make("repo_fix", sandboxes=reused)
    seen = {}
    for iid in env.repo_tasks.ids():
        family = env.repo_tasks.instance(iid).family
        if family not in seen:
            seen[family] = (await expert_episode(env, iid))[0]
    assert seen == dict.fromkeys(seen, 1.0) and len(seen) == 5
    await env.aclose()


def test_a_failed_edit_is_shown_the_closest_lines():
    text = "def f(a, b):\n    x = a + b\n    return x\n\n\ndef g():\n    return 1\n"
    assert closest_lines("x = a+b", text) == (2, "    x = a + b")  # whitespace lost
    assert closest_lines("    x = a + b\n    return  x", text) == (2, "    x = a + b\n    return x")  # two lines
    twice = text.replace("return 1", "return x")
    assert closest_lines("    return 1", twice) == (3, "    return x")  # of two places, the first
    assert closest_lines("completely unrelated words", text) is None  # nothing near enough to name
    assert closest_lines("a\n" * 9, text) is None  # more lines than the file has
    assert closest_lines("x = a", "x = a + b\n" * 20_001) is None  # a search too long to make


@pytest.mark.parametrize("reused", ["bwrap"], indirect=True)
async def test_a_turn_s_state_is_the_repository_s(reused):
    """repo_fix names its states (GiGPO's step groups): turns that read share the repository's state, an edit
    makes another, and undoing it comes back to the first."""
    env = agentrl.make("repo_fix", sandboxes=reused)
    _, info = await env.areset(options={"task_id": TASK})

    async def key(action: str) -> str:
        return (await env.astep(action))[4]["state_key"]

    assert info["state_key"] == await key(call("bash", command="ls")) == await key(call("view", path="setup.py"))
    edited = await key(call("bash", command="echo '# x' >> inifile/values.py"))
    assert edited != info["state_key"]
    assert await key(call("bash", command="sed -i '$ d' inifile/values.py")) == info["state_key"]
    await env.aclose()


async def served(env, action: str) -> str:
    """The observation of a step that goes on, the agent's error or not: never an infrastructure failure."""
    obs, _, term, trunc, info = await env.astep(action)
    assert not (term or trunc) and info["failure"] is FailureClass.OK, info.get("error")
    return obs[0]["content"]


@pytest.mark.parametrize("reused", ["bwrap"], indirect=True)
async def test_a_file_the_sandbox_refuses_and_a_nul_byte_are_the_agent_s_errors(reused):
    """A FIFO (an open() of it would wait for a writer for good), a link, a NUL byte in a path or a command line: each
    tool says why it cannot, as an error the agent reads, and the sandbox serves on (none is an infra_error)."""
    env = agentrl.make("repo_fix", sandboxes=reused)
    await env.areset(options={"task_id": TASK})

    await served(env, call("bash", command="mkfifo pipe.py && ln -s inifile/values.py link.py"))
    fifo = "/work/repo/pipe.py is a FIFO, not a regular file"
    assert f"Error: cannot read pipe.py: {fifo}" in await served(env, call("view", path="pipe.py"))
    assert f"Error: cannot read pipe.py: {fifo}" in await served(env, call("edit", path="pipe.py", old="a", new="b"))
    assert f"Error: cannot create pipe.py: {fifo}" in await served(env, call("create", path="pipe.py", content="x"))
    assert "/work/repo/link.py is a symbolic link" in await served(env, call("view", path="link.py"))
    for action in [
        call("view", path="inifile/values.py\0"),
        call("edit", path="inifile/values.py\0", old="a", new="b"),
        call("create", path="new\0.py", content=""),
        call("bash", command="echo \0"),
        call("run_tests", selector="tests/test_config.py::test_getint\0"),
    ]:
        assert "holds a NUL byte" in await served(env, action)
    assert "stdout:\nserving" in await served(env, call("bash", command="echo serving"))
    await env.aclose()


@pytest.mark.parametrize("reused", ["bwrap"], indirect=True)
async def test_view_and_edit_number_lines_as_grep_does_and_a_crlf_file_is_edited_as_shown(reused):
    """A form feed or a lone CR is inside a line for grep, sed and tracebacks (str.splitlines would end a line there
    and number the rest wrongly). A CRLF file's lines are shown without their CR, and an edit of several of them, as
    shown, applies and keeps the file's line ends."""
    env = agentrl.make("repo_fix", sandboxes=reused)
    await env.areset(options={"task_id": TASK})

    await served(
        env, call("bash", command=r"printf 'a\fb\nc\rd\ne\n' > ff.py; printf 'x = 1\r\ny = 2\r\nz = 3\r\n' > crlf.py")
    )
    assert await served(env, call("view", path="ff.py", start=3, end=3)) == "[ff.py (lines 3-3 of 3)]\ne"
    assert (
        await served(env, call("edit", path="ff.py", old="e", new="E"))
        == "Edited ff.py. Lines 1-3 now read:\na\fb\nc\rd\nE"
    )
    assert await served(env, call("view", path="crlf.py")) == "[crlf.py]\nx = 1\ny = 2\nz = 3"
    edited = await served(env, call("edit", path="crlf.py", old="x = 1\ny = 2", new="x = 10\ny = 20"))
    assert edited == "Edited crlf.py. Lines 1-3 now read:\nx = 10\ny = 20\nz = 3"
    assert "stdout:\nx = 10^M$\ny = 20^M$\nz = 3^M$\n" in await served(env, call("bash", command="cat -A crlf.py"))
    await env.aclose()


@pytest.mark.parametrize("reused", ["bwrap"], indirect=True)
async def test_a_large_file_beside_the_fix_and_a_tree_the_diff_cannot_read_are_the_agent_s_doing(reused):
    """A large new file beside the fix (the diff's texts, as JSON, pass the 1 MiB a sandbox program may print) is
    graded with it, and every turn names its state. A folder the diff's walk cannot read (locked by the agent) is
    a state too, and its submission is graded 0: neither fails the episode (never scored) as the sandbox's fault."""
    env = agentrl.make("repo_fix", sandboxes=reused)
    (path, old, new), *_ = expert_edits(env.repo_tasks.instance(TASK))
    for setup, fix, resolved in [
        ("""python3 -c "open('notes.txt', 'w').write('\\u00e9' * 300_000)" """, True, True),
        ("mkdir locked && touch locked/f && chmod 400 locked", False, False),
    ]:
        await env.areset(options={"task_id": TASK})
        actions = [call("bash", command=setup), *([call("edit", path=path, old=old, new=new)] if fix else [])]
        for action in actions:
            _, _, term, trunc, info = await env.astep(action)
            assert not (term or trunc) and info["failure"] is FailureClass.OK, info.get("error")
            assert info["state_key"] is not None
        _, reward, term, _, info = await env.astep(call("submit"))
        assert term and info["failure"] is FailureClass.OK and info["resolved"] is resolved
        assert reward == float(resolved) and ("notes.txt" in info.get("changed_files", [])) is fix
    await env.aclose()


@pytest.mark.slow  # the fast tier is at its budget; the expert's episode covers the code
@ON_DOCKER
async def test_the_tools_and_the_shell_state(reused):
    env = agentrl.make("repo_fix", sandboxes=reused)
    obs, info = await env.areset(options={"task_id": TASK})
    assert {t["function"]["name"] for t in info["tools"]} == {"bash", "view", "edit", "create", "run_tests", "submit"}
    assert "<issue>" in obs[1]["content"] and "inifile/values.py" in obs[1]["content"]

    async def step(action: str) -> str:
        out, _, term, trunc, step_info = await env.astep(action)
        assert not (term or trunc) and step_info["failure"] is not FailureClass.INFRA
        return "\n".join(m["content"] for m in out)

    # bash: the working directory and exported variables persist across calls (also past `exit`)
    assert "/work/repo" in await step(call("bash", command="pwd; export FLAVOUR=mint; cd inifile; exit 3"))
    assert "exit code 0\nstdout:\n/work/repo/inifile mint" in await step(call("bash", command="echo $PWD $FLAVOUR"))
    assert "killed: time limit" in await step(call("bash", command="sleep 60"))  # bash_timeout_s
    # a call killed at its limit keeps the state it began with
    assert "/work/repo/inifile" in await step(call("bash", command="pwd"))
    # view: the file, a range, and what it cannot show
    assert (await step(call("view", path="inifile/values.py", start=2, end=3))).startswith(
        "[inifile/values.py (lines 2-3 of "
    )
    assert "no such file" in await step(call("view", path="inifile/nope.py"))
    # a mistyped path: the error names the file meant
    assert "no such file; did you mean inifile/values.py?" in await step(call("view", path="inifle/value.py"))
    assert "outside the repository" in await step(call("view", path="../../etc/passwd"))
    assert "outside the repository" in await step(call("view", path="/etc/passwd"))
    # edit: exactly one occurrence, or nothing changes and the agent reads why
    assert "old was not found" in await step(call("edit", path="inifile/values.py", old="nope(", new="x"))
    (path, old, new), *_ = expert_edits(env.instance)  # misquoted: the error shows the text it meant
    retyped = await step(call("edit", path=path, old=misquote(old, env.instance.repo[path]), new=new))
    assert retyped.startswith("Error: no edit made: old was not found") and retyped.endswith(f":\n{old}")
    assert "old occurs" in await step(call("edit", path="inifile/values.py", old="text", new="x"))
    # create: a new file only
    assert "exists; change it with edit" in await step(call("create", path="inifile/values.py", content=""))
    assert (await step(call("create", path="notes/todo.txt", content="a\nb\n"))) == "Created notes/todo.txt (2 lines)."
    # run_tests: the visible tests, or a selection of them; never a file that is not a test
    assert " passed" in await step(call("run_tests"))
    assert "1 passed" in await step(call("run_tests", selector="tests/test_config.py::test_getint"))
    assert "is not a test file" in await step(call("run_tests", selector="inifile/values.py"))
    # the next episode, in the same (recycled) container, starts with a shell of its own
    first = (await env.sandbox()).name
    await env.areset(options={"task_id": TASK})
    assert (await env.sandbox()).name == first
    fresh = await step(call("bash", command="echo $PWD [$FLAVOUR]; ls /work/repo/notes"))
    assert "stdout:\n/work/repo []" in fresh and "No such file" in fresh  # the last episode's file is gone too
    await env.aclose()


@pytest.mark.slow  # the fast tier is at its budget; the expert's episode covers the code
@ON_DOCKER
async def test_the_last_turn_grades_what_is_there(reused):
    env = agentrl.make("repo_fix", sandboxes=reused, max_turns=2)
    await env.areset(options={"task_id": TASK})
    (path, old, new), *_ = expert_edits(env.instance)
    obs, *_ = await env.astep(call("edit", path=path, old=old, new=new))
    assert obs[-1] == {"role": "user", "content": "One turn left: submit now."}
    obs, reward, term, trunc, info = await env.astep(call("bash", command="true"))
    assert (reward, term, trunc) == (1.0, True, False) and info["autosubmitted"] and info["resolved"]
    no_auto = agentrl.make("repo_fix", sandboxes=reused, max_turns=1, autosubmit=False)
    await no_auto.areset(options={"task_id": TASK})
    _, reward, term, trunc, info = await no_auto.astep(call("bash", command="true"))
    assert (reward, term, trunc) == (0.0, False, True) and "outcome" not in info
    await env.aclose()
    await no_auto.aclose()


@pytest.mark.slow  # the fast tier is at its budget; the expert's episode covers the code
@ON_DOCKER
async def test_changes_to_tests_and_config_are_left_out_of_a_fix(reused):
    env = agentrl.make("repo_fix", sandboxes=reused)
    await env.areset(options={"task_id": TASK})
    (path, old, new), *_ = expert_edits(env.instance)
    await env.astep(call("edit", path=path, old=old, new=new))
    await env.astep(call("bash", command="echo 'x = 1' > conftest.py; echo >> tests/test_config.py; touch a.pth"))
    _, reward, *_, info = await env.astep(call("submit"))
    assert reward == 1.0 and info["resolved"]
    assert info["left_out"] == {
        "a.pth": "a .pth file",
        "conftest.py": "conftest.py",
        "tests/test_config.py": "a test file",
    }
    await env.aclose()


# ---------------------------------------------------------------------------------------------------------------
# Hostile agents: each earns no more than a submission of no change (0 on every generated instance), or its call
# fails cleanly; then an honest episode in the same container still earns 1.

PASS_ALL_HOOK = (
    "import pytest\n\n\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
    "    outcome = yield\n    report = outcome.get_result()\n    report.outcome = 'passed'\n"
)
TAMPER = (
    "\nimport pathlib as _p\n_t = _p.Path(__file__).resolve().parents[1] / 'tests' / 'test_regressions.py'\n"
    "if _t.exists():\n    _t.write_text('def test_ok():\\n    pass\\n')\n"
)
NEW_TESTS = "rm -rf tests && mkdir tests && echo 'def test_x(): pass' > tests/test_config.py"
SKIP_ALL = "[pytest]\naddopts = -k nothing\n"
HOSTILE = {
    "never_exits": [call("bash", command="sleep 1000"), call("bash", command="nohup sleep 1000 & disown; echo bg")],
    "fork_bomb": [call("bash", command=":(){ :|:& };:")],
    "floods_the_shell": [call("bash", command="yes"), call("bash", command="head -c 50000000 /dev/zero | tr '\\0' x")],
    "removes_the_repository": [call("bash", command="cd /work && rm -rf repo")],
    "rewrites_the_visible_tests": [call("bash", command=NEW_TESTS)],
    "conftest_passes_everything": [
        call("create", path="conftest.py", content=PASS_ALL_HOOK),
        call("create", path="inifile/conftest.py", content=PASS_ALL_HOOK),
    ],
    "sitecustomize_and_pth": [
        call("create", path="sitecustomize.py", content="import sys; sys.exit(0)\n"),
        call("create", path="evil.pth", content="import os; os._exit(0)\n"),
    ],
    "pytest_config_skips_tests": [
        call("create", path="pytest.ini", content=SKIP_ALL),
        call("create", path="setup.cfg", content=SKIP_ALL.replace("[pytest]", "[tool:pytest]")),
    ],
    "plugin_in_package_metadata": [
        call("create", path="evil-1.0.dist-info/entry_points.txt", content="[pytest11]\nevil = conftest\n"),
        call("create", path="evil-1.0.dist-info/METADATA", content="Name: evil\nVersion: 1.0\n"),
    ],
    "exits_on_import": [call("bash", command="echo 'import os; os._exit(0)' >> inifile/__init__.py")],
    "leaves_what_would_block_a_read": [
        call("bash", command="mkfifo inifile/fifo.py && ln -s fifo.py inifile/link.py"),
        call("view", path="inifile/fifo.py"),
        call("create", path="inifile/link.py", content="x = 1\n"),
        call("view", path="inifile/values.py\0"),
    ],
    "tampers_with_the_hidden_tests": [],  # the real fix, plus code that would rewrite the hidden tests when graded
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(HOSTILE))
async def test_a_hostile_agent_earns_nothing_and_breaks_nothing(reused, name):
    env = agentrl.make("repo_fix", sandboxes=reused, bash_timeout_s=3.0)  # a shorter wait for what never exits
    await env.areset(options={"task_id": TASK})
    first = (await env.sandbox()).name
    actions = list(HOSTILE[name])
    if name == "tampers_with_the_hidden_tests":
        (path, old, new), *_ = expert_edits(env.instance)
        actions = [call("edit", path=path, old=old, new=new + TAMPER)]
    for action in actions:
        obs, reward, term, trunc, info = await env.astep(action)
        assert not (term or trunc) and info["failure"] is FailureClass.OK, info.get("error")
        assert all(len(m["content"]) <= env.cfg.max_observation_chars + 100 for m in obs)  # output stays capped
    _, reward, term, trunc, info = await env.astep(call("submit"))
    assert term and info["failure"] is FailureClass.OK
    if name == "tampers_with_the_hidden_tests":
        # graded by value tests, which never put the hidden tests in a file: nothing to rewrite, and the real fix
        # earns what it earns (the pytest path's check of the test files: tests/env/test_repo_grading.py)
        assert reward == 1.0 and info["resolved"], info
    else:
        assert reward == 0.0 and not info["resolved"], info
    reward, _, second = await expert_episode(env)
    assert reward == 1.0 and second == first  # the same container, recycled, serves an honest episode
    await env.aclose()


@pytest.mark.docker
@pytest.mark.slow  # the fast tier is at its budget
async def test_submissions_of_no_change_share_one_grading_and_a_change_gets_its_own(sandbox_image):
    """An unchanged repository grades the same every time: three concurrent submissions of no change on one
    instance start one grading sandbox between them, and all get its verdict; a fix is graded in its own."""
    graders = []

    async def grader() -> DockerSandbox:
        sandbox = await DockerSandbox.create()
        graders.append(sandbox.name)
        return sandbox

    pool = SandboxPool(DockerSandbox.create, size=3, reuse=100)
    source = SandboxSource(pool, factory=grader)  # the pool's workspaces are not counted, grading sandboxes are
    task = "repo-inifile-5"  # no other test of this process submits it unchanged

    async def give_up() -> tuple:
        env = agentrl.make("repo_fix", sandboxes=source)
        await env.areset(options={"task_id": task})
        out = await env.astep(call("submit"))
        await env.aclose()
        return out

    try:
        await pool.start()
        outs = await asyncio.gather(*(give_up() for _ in range(3)))
        assert len(graders) == 1
        for _, reward, term, _, info in outs:
            assert term and reward == 0.0 and info["diff"] == "" and not info["resolved"], info
            assert info["tests_passed"] == 0 and info["tests_total"] > 0 and info["pass_to_pass_broken"] == 0, info
        env = agentrl.make("repo_fix", sandboxes=source)
        reward, _, _ = await expert_episode(env, task)
        await env.aclose()
        assert reward == 1.0 and len(graders) == 2
    finally:
        await pool.close()


@pytest.mark.slow  # the fast tier is at its budget; the expert's episode covers the code
async def test_the_hidden_tests_never_reach_the_agents_sandbox(reused):
    env = agentrl.make("repo_fix", sandboxes=reused)
    await env.areset(options={"task_id": TASK})
    hidden = apply_patch(env.instance.repo, env.instance.test_patch)[HIDDEN_TESTS]
    marker = next(line for line in hidden.splitlines() if line.startswith("def test_"))  # a hidden test's name
    sandbox = await env.sandbox()
    # every place of the container a file could have been put (all but the image's own /usr, and /proc, /sys)
    places = "/work /tmp /opt /run /var /home /root /etc /srv /mnt /dev/shm /code"
    found = await sandbox.run(
        ["bash", "-c", f"grep -rlF '{marker}' {places} 2>/dev/null; ls -a /work /tmp"], timeout_s=60
    )
    assert marker not in found.stdout and HIDDEN_TESTS.split("/")[-1] not in found.stdout
    # grading happens elsewhere: after a submission, still nothing of the hidden tests here
    await env.astep(call("submit"))
    after = await sandbox.run(["bash", "-c", f"grep -rlF '{marker}' /work /tmp 2>/dev/null"], timeout_s=30)
    assert after.stdout == ""
    await env.aclose()


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_one_hundred_concurrent_episodes_on_a_pool_of_eight_leave_no_container(sandbox_image, docker_client):
    mine = {"label": f"{reaper.SESSION_LABEL}={reaper.SESSION_ID}"}
    pool = SandboxPool(DockerSandbox.create, size=8)
    rewards = []

    async def one(i: int) -> None:  # the expert's edits and a submission: each episode holds two sandboxes
        env = agentrl.make("repo_fix", sandboxes=SandboxSource(pool))
        await env.areset(options={"task_id": env.repo_tasks.ids()[i % 40]})
        edits = [call("edit", path=p, old=o, new=n) for p, o, n in expert_edits(env.instance)]
        for action in [*edits, call("submit")]:
            _, reward, term, _, info = await env.astep(action)
            assert info["failure"] is FailureClass.OK, info.get("error")
        rewards.append(reward if term else None)
        await env.aclose()

    try:
        await pool.start()
        await asyncio.gather(*(one(i) for i in range(100)))
    finally:
        await pool.close()
    assert rewards == [1.0] * 100
    assert docker_client.api.containers(all=True, filters=mine) == []


@pytest.mark.docker
@pytest.mark.slow
def test_agentrl_eval_on_repo_fix_gives_pass_at_k_and_transcripts_with_the_diff(sandbox_image, tmp_path):
    from cli import agentrl as run_agentrl

    out = tmp_path / "eval"
    run_agentrl(
        "eval",
        "--env",
        "repo_fix",
        "--model",
        "default",
        "--tasks",
        2,
        "--samples",
        2,
        "--k",
        "1,2",
        "--set",
        "env_kwargs.max_turns=3",
        "--out",
        out,
        timeout=600,
    )
    summary = json.loads((out / "summary.json").read_text())
    assert (
        summary["env"] == "repo_fix" and summary["problems"] == 2 and set(summary["pass_at_k"]) == {"pass@1", "pass@2"}
    )
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["n"] for r in results] == [2, 2]
    transcripts = [json.loads(line) for line in (out / "trajectories" / "eval.jsonl").read_text().splitlines()]
    assert len(transcripts) == 4
    # every episode ended graded (a submission, or the last turn's autosubmit), its diff in the last turn's info
    assert all(isinstance(t["turns"][-1]["info"].get("diff"), str) for t in transcripts)


# ---------------------------------------------------------------------------------------------------------------
# Loaded instances (SWE-bench-style JSONL; tests/repo_data.py builds the repository)


@pytest.mark.docker
@pytest.mark.slow  # the fast tier is at its budget; the expert's episode covers the code
async def test_a_loaded_instance_validates_and_is_solved_in_sandboxes(sandbox_image, tmp_path):
    from repo_data import BUGGY, git_repo, record, write_jsonl

    from agentrl.env.repos import validate_instance

    commit = git_repo(tmp_path / "mathy", BUGGY)
    data = write_jsonl(tmp_path / "data.jsonl", record("mathy", commit))
    env = agentrl.make("repo_fix", tasks=f"swebench:{data}", split="all")
    (iid,) = env.repo_tasks.ids()
    async with await DockerSandbox.create() as sandbox:
        report = await validate_instance(env.repo_tasks.instance(iid), sandbox)
    assert report.ok, report.problems
    reward, info, _ = await expert_episode(env, iid)
    assert reward == 1.0 and info["changed_files"] == ["mathy/ops.py"]
    await env.aclose()


async def test_validate_repos_checks_on_the_backend_asked_for_and_refuses_an_unusable_image(bwrap_site, tmp_path):
    """`agentrl envs validate-repos --backend bwrap` checks a loaded instance with no Docker. An instance's image that
    cannot be used is refused in one line: on bwrap a file that is not a `docker save` tarball, on local sandboxes
    any (they run on the host)."""
    from cli import agentrl as run_agentrl
    from repo_data import BUGGY, git_repo, record, write_jsonl

    from agentrl.env.repos import image_sandbox

    commit = git_repo(tmp_path / "mathy", BUGGY)
    good = write_jsonl(tmp_path / "good.jsonl", record("mathy", commit))
    r = run_agentrl("envs", "validate-repos", f"swebench:{good}", "--backend", "bwrap")
    assert r.stdout.endswith("1 of 1 instances valid\n")
    (tmp_path / "deps.tar").write_text("not a tar file")
    bad = write_jsonl(tmp_path / "bad.jsonl", record("mathy", commit, image="deps.tar"))
    r = run_agentrl("envs", "validate-repos", f"swebench:{bad}", "--backend", "bwrap", check=False)
    tarball = tmp_path / "deps.tar"
    assert (r.returncode, r.stderr.splitlines()[-1]) == (
        3,
        f"sandbox failure: the instance's image {tarball} cannot be used: {tarball} is not a tar file: make one "
        "with `docker save IMAGE -o FILE`",
    ), r.stderr
    with pytest.raises(SandboxError, match="needs a docker or bwrap sandbox: local ones run on the host"):
        await image_sandbox(str(tarball), SandboxConfig(backend="local"))


DEPS = "agentrl-test-deps:1"


@pytest.fixture(scope="module")
def deps_image(sandbox_image, docker_client, tmp_path_factory) -> Path:
    """A `docker save` tarball of an image with a module the sandbox image lacks (mathdeps), built offline."""
    module = "pathlib.Path(site.getsitepackages()[0], 'mathdeps.py').write_text('def top(hi):\\\\n    return hi\\\\n')"
    context = tmp_path_factory.mktemp("deps")
    (context / "Dockerfile").write_text(
        f'FROM {sandbox_image}\nUSER 0\nRUN python3 -c "import site, pathlib; {module}"\n'
    )
    docker_client.images.build(path=str(context), tag=DEPS, rm=True, network_mode="none")
    tarball = context / "deps.tar"
    try:
        with open(tarball, "wb") as f:
            for chunk in docker_client.images.get(DEPS).save(named=True):
                f.write(chunk)
    finally:
        docker_client.images.remove(DEPS, force=True)
    return tarball


@pytest.mark.docker  # to save the instance's image; bwrap then unpacks the tarball without it
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["docker", "bwrap"])
async def test_an_instance_with_its_own_image_runs_and_grades_in_it(
    request, backend, deps_image, docker_client, tmp_path
):
    """An instance whose package needs a dependency only its image has: it validates, and is solved, in sandboxes
    of that image (locked down as any), and does not validate in the default one."""
    from repo_data import git_repo, write_jsonl

    from agentrl.env.repos import image_sandbox, validate_instance
    from agentrl.sandbox.image import saved_rootfs_dir
    from agentrl.tasks.repos import make_patch

    if backend == "bwrap":
        request.getfixturevalue("bwrap_site")
    buggy = {
        "dep/__init__.py": "from mathdeps import top\n\n\ndef cap(x, hi):\n    return min(x, top(hi) - 1)\n",
        "tests/test_dep.py": "from dep import cap\n\n\ndef test_low():\n    assert cap(1, 5) == 1\n",
    }
    fixed = {**buggy, "dep/__init__.py": buggy["dep/__init__.py"].replace("top(hi) - 1", "top(hi)")}
    hidden = {**buggy, "tests/test_hidden.py": "from dep import cap\n\n\ndef test_high():\n    assert cap(9, 5) == 5\n"}
    commit = git_repo(tmp_path / "dep", buggy)
    rec = {
        "instance_id": "dep-1",
        "repo": "dep",
        "base_commit": commit,
        "problem_statement": "cap(9, 5) is 4",
        "patch": make_patch(buggy, fixed),
        "test_patch": make_patch(buggy, hidden),
        "FAIL_TO_PASS": ["tests/test_hidden.py::test_high"],
        "PASS_TO_PASS": ["tests/test_dep.py::test_low"],
        "image": str(deps_image),
    }
    config = SandboxConfig(backend=backend)
    env = agentrl.make(
        "repo_fix",
        tasks=f"swebench:{write_jsonl(tmp_path / 'd.jsonl', rec)}",
        split="all",
        sandboxes=SandboxSource(size=1, sandbox=config),  # its pool stays idle: every episode runs in the image
    )
    inst = env.repo_tasks.instance("dep-1")
    tags = []
    try:
        async with await image_sandbox(inst.image, config) as sandbox:
            if backend == "docker":
                tags.append(sandbox.container.image.tags[0])
            assert (await validate_instance(inst, sandbox)).ok
            locked = await sandbox.run(["bash", "-c", "id -u; cat /proc/1/status | grep CapEff"], timeout_s=10)
            assert locked.stdout.startswith("65534\n")
        async with await backend_factory(backend)() as plain:
            assert not (await validate_instance(inst, plain)).ok  # the dependency is the image's alone
        reward, info, name = await expert_episode(env, "dep-1")
        assert reward == 1.0 and info["resolved"] and name.startswith("agentrl-" if backend == "docker" else "bwrap-")
    finally:
        await env.aclose()
        for tag in [*tags, DEPS]:  # the sandbox image, then the instance's image its tarball's load named again
            with contextlib.suppress(docker.errors.ImageNotFound):
                docker_client.images.remove(tag, force=True)
        shutil.rmtree(saved_rootfs_dir(deps_image), ignore_errors=True)  # bwrap's, unpacked from it: for no later run
