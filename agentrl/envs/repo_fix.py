"""repo_fix: fix the bug an issue describes in a multi-file repository, with a shell, file tools and the visible
tests; graded as SWE-bench grades (docs/design.md, "Repository tasks").

At reset the instance's repository is placed at /work/repo in the episode's sandbox and the agent reads the issue
(and the repository's file list). Its tools act there; `submit` takes its diff of non-test files, applies it to a
clean checkout in a fresh sandbox with the hidden tests added, and runs FAIL_TO_PASS and PASS_TO_PASS
(`agentrl.env.repos`). The hidden tests never enter the agent's sandbox, and no reward before the outcome looks
at them.
"""

from __future__ import annotations

import asyncio
import difflib
import hashlib
import json
import random
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection
from typing import Any, Literal

from pydantic import Field

from agentrl.env import StepResult, ToolEnv, ToolEnvConfig
from agentrl.env.base import FailureClass, Message
from agentrl.env.demos import Mistake
from agentrl.env.repos import (
    REPO,
    RepoError,
    RepoGrade,
    agent_diff,
    bash_argv,
    changes,
    grade,
    image_sandbox,
    is_test_path,
    place,
    pytest_argv,
    repo_path,
)
from agentrl.env.tools import ToolCall, ToolError, ToolOutput, tool
from agentrl.envs._format import run_output
from agentrl.sandbox import ExecResult, Sandbox, SandboxConfig
from agentrl.tasks import Task
from agentrl.tasks.repos.instance import RepoInstance, git_lines
from agentrl.tasks.repos.taskset import RepoTaskSet
from agentrl.tasks.solutions import PERFECT, Expert, chance

SYSTEM = """You are fixing a bug in the Python repository at /work/repo, with the tools. You have {turns} turns.
Find the cause of the issue, fix it in the package (changes to tests do not count), check the fix, then submit()."""


class RepoFixConfig(ToolEnvConfig):
    tasks: str = "repos"
    """repos (generated repositories; `repos:templates=test` for the held-out templates) or swebench:PATH"""
    max_turns: int = Field(20, ge=1)
    max_observation_chars: int = Field(2000, ge=200)
    outcome: Literal["fraction", "all"] = "fraction"
    """outcome reward: the share of FAIL_TO_PASS tests that pass (0 when a PASS_TO_PASS test breaks), or 1 only
    when the issue is resolved (all pass)"""
    bash_timeout_s: float = Field(10.0, gt=0)
    """wall-clock limit of one bash call"""
    test_timeout_s: float = Field(60.0, gt=0)
    """wall-clock limit of one run_tests call"""
    grade_timeout_s: float = Field(120.0, gt=0)
    """wall-clock limit of the hidden tests' run"""
    autosubmit: bool = True
    """when the last turn ends without a submission, grade the repository as it is (SWE-agent's exit); false:
    no outcome (truncated)"""
    list_files: int = Field(60, ge=0)
    """show up to this many of the repository's files with the issue (0: none)"""
    pytest_plugins: bool = False
    """let pytest load the plugins installed in the image (a per-instance image may need them); never those of the
    repository, whose package metadata is left out of the agent's diff"""


class BaseGrades:
    """The hidden tests' verdict on an unchanged repository, per instance and grading settings, kept for this
    process: a clean checkout with nothing applied grades the same every time, so one run in a fresh sandbox
    serves every submission of no change. In RL most failed episodes submit none (they looked in the wrong module,
    or their edit failed), and each grading costs a container's start and a pytest run. Concurrent submissions of
    the same instance wait for the one run."""

    def __init__(self, size: int = 4096):
        self.size = size
        self._done: OrderedDict[str, RepoGrade] = OrderedDict()
        self._running: dict[str, asyncio.Task[RepoGrade]] = {}

    @staticmethod
    def key(instance: RepoInstance, *, plugins: bool, timeout_s: float) -> str:
        """Everything the verdict depends on: the repository, the hidden tests, their ids, the image, the settings."""
        data = [
            sorted(instance.repo.items()),
            instance.test_patch,
            instance.FAIL_TO_PASS,
            instance.PASS_TO_PASS,
            instance.image,
            plugins,
            timeout_s,
        ]
        return hashlib.sha256(json.dumps(data).encode()).hexdigest()

    async def get(self, key: str, run: Callable[[], Awaitable[RepoGrade]]) -> RepoGrade:
        if key in self._done:
            self._done.move_to_end(key)
            return self._done[key]
        task = self._running.get(key)
        if task is None or task.get_loop() is not asyncio.get_running_loop():
            task = self._running[key] = asyncio.ensure_future(run())
            task.add_done_callback(lambda t: self._finished(key, t))
        return await asyncio.shield(task)  # a waiter cancelled leaves the run to the others

    def _finished(self, key: str, task: asyncio.Task[RepoGrade]) -> None:
        if self._running.get(key) is task:
            del self._running[key]
        # a run that failed, or left a test without an outcome (a time-out on a loaded machine), is not kept: the next
        # submission of no change runs it again
        if not task.cancelled() and task.exception() is None and not task.result().missing:
            self._done[key] = task.result()
            while len(self._done) > self.size:
                self._done.popitem(last=False)


BASE_GRADES = BaseGrades()


class RepoFixEnv(ToolEnv):
    """Repository-level bug fixing (SWE-bench style) in a sandbox, graded by hidden pytest tests."""

    description = "Fix an issue in a multi-file Python repository with a shell and file tools; hidden tests grade it."
    reward_doc = (
        "outcome (on submit, or at the last turn with autosubmit): the share of FAIL_TO_PASS tests passing, 0 if a "
        "PASS_TO_PASS test broke (outcome=all: 1 only when resolved); malformed: malformed_penalty per bad tool "
        "call or message without one. No per-turn term looks at the hidden tests."
    )
    Config = RepoFixConfig
    cfg: RepoFixConfig

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        if not isinstance(self.task_set, RepoTaskSet):
            raise ValueError(f"repo_fix needs a repository task set (repos, swebench:PATH), not {self.cfg.tasks!r}")
        self.repo_tasks: RepoTaskSet = self.task_set
        self.instance: RepoInstance | None = None
        self._own: Sandbox | None = None  # the workspace of an instance with its own image

    async def sandbox(self) -> Sandbox:
        """The episode's workspace: from the pool, or of the instance's own image."""
        if self.instance is None or self.instance.image is None:
            return await super().sandbox()
        if self._own is None:
            self._own = await self.timed(image_sandbox(self.instance.image, self._backend()))
        return self._own

    def _backend(self) -> SandboxConfig:
        """The backend of this env's sandboxes, which an instance's own image runs on too (a source made for the
        env on first use, `SandboxSource.default`, is the default backend's)."""
        return self._sandboxes.config if self._sandboxes is not None else SandboxConfig()

    async def _release_sandbox(self) -> None:
        own, self._own = self._own, None
        if own is not None:
            await own.close()
        await super()._release_sandbox()

    async def _reset(self, task: Task) -> list[Message]:
        self.instance = self.repo_tasks.instance(task.id)
        await self.timed(place(await self.sandbox(), self.instance.repo))
        prompt = f"<issue>\n{self.instance.problem_statement.strip()}\n</issue>"
        if self.cfg.list_files:
            files = sorted(self.instance.repo)
            shown = files[: self.cfg.list_files]
            more = f"\n... and {len(files) - len(shown)} more" if len(files) > len(shown) else ""
            prompt += "\n\nFiles in /work/repo:\n" + "\n".join(shown) + more
        return [
            {"role": "system", "content": SYSTEM.format(turns=self.cfg.max_turns)},
            {"role": "user", "content": prompt},
        ]

    async def _step(self, action: str) -> StepResult:
        result = await super()._step(action)
        last = self.turn + 1 >= self.cfg.max_turns
        if not result.terminated and last and self.cfg.autosubmit:
            out = await self._grade(autosubmitted=True)
            result.observation.append({"role": "user", "content": out.content})
            result.reward_breakdown.update(out.reward)
            result.info.update(out.info)
            result.terminated = True
        elif not result.terminated and self.turn + 2 == self.cfg.max_turns:
            result.observation.append({"role": "user", "content": "One turn left: submit now."})
        return result

    names_states = True

    async def state_key(self) -> str:
        """The repository's state: a hash of what changed since the instance was placed (GiGPO's step groups:
        turns that read the same repository, whatever they printed, share one)."""
        try:
            found = await self.timed(changes(await self.sandbox(), self.instance.repo))
        except RepoError:  # the agent's own doing (a folder it locked, a tree too big to walk): a state, graded 0
            return "unreadable"
        return hashlib.sha256(found.model_dump_json().encode()).hexdigest()[:32]

    async def _no_call(self, text: str) -> StepResult:
        return self.malformed("no tool call found. Call a tool in <tool_call> tags; submit() when done.", role="user")

    # ---- a hosted agent program (`agentrl.register(name, agent=..., env="repo_fix")`)

    hosts_agents = True

    async def agent_run(self, command: str) -> ExecResult:
        """The agent's command, as the `bash` tool runs it: in the repository, its cwd and exports kept."""
        sandbox = await self.sandbox()
        return await self.timed(sandbox.run(bash_argv(command), timeout_s=self.cfg.bash_timeout_s))

    async def agent_grade(self) -> tuple[float | None, dict[str, Any]]:
        """What the agent left in the repository, graded as a `submit` is."""
        out = await self._grade(autosubmitted=False)
        self._done = True
        await self._release_sandbox()
        info = dict(out.info) | {"failure": out.failure or FailureClass.OK}
        return out.reward["outcome"], info

    # ---- tools

    @tool
    async def bash(self, command: str) -> ToolOutput:
        """Run a bash command in the repository and return its exit status and output.

        Args:
            command: The command, e.g. `grep -rn "def parse" .`
        """
        no_nul(command, "the command")
        sandbox = await self.sandbox()
        run = await self.timed(sandbox.run(bash_argv(command), timeout_s=self.cfg.bash_timeout_s))
        return run_output(run)

    @tool
    async def view(self, path: str, start: int = 1, end: int = 0) -> str:
        """Show a file of the repository, or its lines start to end.

        Args:
            path: The file's path in the repository, e.g. `pkg/module.py`.
            start: The first line to show (from 1).
            end: The last line to show; 0 for the end of the file.
        """
        rel = self._path(path)
        lines = text_lines(await self._read(rel))
        first, last = max(start, 1), len(lines) if end <= 0 else min(end, len(lines))
        if lines and first > last:
            raise ToolError(f"{rel} has {len(lines)} lines; lines {start} to {end} show nothing")
        head = f"{rel} (lines {first}-{last} of {len(lines)})" if (first, last) != (1, len(lines)) else rel
        return "\n".join([f"[{head}]", *lines[first - 1 : last]])

    @tool
    async def edit(self, path: str, old: str, new: str) -> str:
        """Replace text in a file: old must occur exactly once in it.

        Args:
            path: The file's path in the repository.
            old: The exact text to replace, whitespace included.
            new: The text to put in its place.
        """
        rel = self._path(path)
        text = await self._read(rel)
        old, new = line_ends(text, old, new)
        n = text.count(old) if old else 0
        if n != 1:
            why = "old is empty" if not old else "old was not found" if n == 0 else f"old occurs {n} times"
            hint = "copy it exactly, whitespace included" if n == 0 else "include more lines around it"
            near = closest_lines(old, text) if old and n == 0 else None
            if near is not None:  # the text meant, so a retry copies it from here (as aider's edit errors show it)
                first, lines = near
                last = first + lines.count("\n")
                span = f"line {first}" if last == first else f"lines {first}-{last}"
                hint += f". The closest text, {span}:\n{lines}"
            raise ToolError(f"no edit made: {why} in {rel}; {hint}")
        updated = text.replace(old, new, 1)
        await self._write(rel, updated, f"no edit made: cannot write {rel}")
        at = text[: text.index(old)].count("\n")
        shown = text_lines(updated)[max(at - 2, 0) : at + new.count("\n") + 3]
        return f"Edited {rel}. Lines {max(at - 2, 0) + 1}-{max(at - 2, 0) + len(shown)} now read:\n" + "\n".join(shown)

    @tool
    async def create(self, path: str, content: str) -> str:
        """Create a new file in the repository.

        Args:
            path: The new file's path in the repository.
            content: What the file holds.
        """
        rel = self._path(path)
        sandbox = await self.sandbox()
        try:
            await self.timed(sandbox.read_file(f"{REPO}/{rel}"))
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as e:  # refused by the sandbox: a FIFO, too big, ...
            raise ToolError(f"cannot create {rel}: {refusal(e)}") from None
        else:
            raise ToolError(f"{rel} exists; change it with edit")
        await self._write(rel, content, f"cannot create {rel}")
        return f"Created {rel} ({len(content.splitlines())} lines)."

    @tool
    async def run_tests(self, selector: str = "") -> ToolOutput:
        """Run the repository's tests with pytest: all of them, or those a selector names.

        Args:
            selector: A test file or a test in the repository, e.g. `tests/test_core.py::test_add`; empty for all.
        """
        targets = [t for t in self.instance.repo if is_test_path(t) and t.endswith(".py") and "/test_" in f"/{t}"]
        if selector:
            no_nul(selector, "the selector")
            file, sep, rest = selector.partition("::")
            rel = self._path(file)
            if not is_test_path(rel):
                raise ToolError(f"{rel} is not a test file; give a file under tests/ or a test in one")
            targets = [f"{rel}{sep}{rest}"]
        sandbox = await self.sandbox()
        run = await self.timed(
            sandbox.run(
                pytest_argv(["-q", "--no-header", "-rfE", *targets]), cwd=REPO, timeout_s=self.cfg.test_timeout_s
            )
        )
        out = run_output(run)
        return out.model_copy(update={"content": out.content.replace("stdout:\n", "", 1)})

    @tool
    async def submit(self) -> ToolOutput:
        """Submit your changes: they are graded by hidden tests and the task ends."""
        return await self._grade(autosubmitted=False)

    # ---- helpers

    def _path(self, path: str) -> str:
        try:
            return repo_path(path)
        except ValueError as e:
            raise ToolError(str(e)) from None

    async def _read(self, rel: str) -> str:
        try:
            data = await self.timed((await self.sandbox()).read_file(f"{REPO}/{rel}"))
        except (OSError, ValueError) as e:  # refused by the sandbox: missing, a FIFO, too big, ...
            reason = "no such file" if isinstance(e, FileNotFoundError) else refusal(e)
            if isinstance(e, FileNotFoundError):
                near = near_file(rel, self.instance.repo)
                reason += f"; did you mean {near}?" if near else ""
            raise ToolError(f"cannot read {rel}: {reason}") from None
        try:
            return data.decode()
        except UnicodeDecodeError:
            raise ToolError(f"{rel} is not a UTF-8 text file") from None

    async def _write(self, rel: str, text: str, failed: str) -> None:
        try:
            await self.timed((await self.sandbox()).write_file(f"{REPO}/{rel}", text))
        except (OSError, ValueError) as e:  # refused by the sandbox: a FIFO, a full disk, ...
            raise ToolError(f"{failed}: {refusal(e)}") from None

    async def _grade(self, *, autosubmitted: bool) -> ToolOutput:
        """Take the diff, grade it in a fresh sandbox, end the episode."""
        base = self.instance.repo
        try:
            found = await self.timed(changes(await self.sandbox(), base))
        except RepoError as e:  # the agent's own doing (a tree too big to walk in time): nothing to grade
            info = {"outcome": 0.0, "resolved": False, "diff": "", "grading": f"no diff: {e}"}
            return ToolOutput(
                content=f"Not graded: the repository could not be read ({e}).",
                reward={"outcome": 0.0},
                terminated=True,
                info=info,
            )
        diff = agent_diff(base, found)
        instance, cfg = self.instance, self.cfg

        async def run() -> RepoGrade:
            image = instance.image  # grading runs where no agent code ran: a new sandbox, outside the pool
            fresh = await (image_sandbox(image, self._backend()) if image else self._sandboxes.fresh())
            try:
                return await grade(
                    fresh, instance, diff.patch, timeout_s=cfg.grade_timeout_s, plugins=cfg.pytest_plugins
                )
            finally:
                await (fresh.close() if image else self._sandboxes.done(fresh))

        if diff.patch:
            result = await self.timed(run())
        else:
            key = BASE_GRADES.key(instance, plugins=cfg.pytest_plugins, timeout_s=cfg.grade_timeout_s)
            result = await self.timed(BASE_GRADES.get(key, run))
        outcome = result.outcome(self.cfg.outcome)
        info = {
            "outcome": outcome,
            "resolved": result.resolved,
            "diff": diff.patch,
            "changed_files": diff.files,
            "left_out": diff.left_out,
            "autosubmitted": autosubmitted,
            "tests_passed": result.fixed,
            "tests_total": len(result.fail_to_pass),
            "pass_to_pass_broken": result.broke,
        }
        if result.problem is not None:
            info["grading"] = result.problem
        failure = FailureClass.TAMPERED if result.tampered else None
        lines = [result.summary()]
        if not diff.files:
            lines.append("You changed no non-test file.")
        if diff.left_out:
            lines.append(f"Left out of your change: {', '.join(f'{p} ({w})' for p, w in diff.left_out.items())}.")
        return ToolOutput(
            content=" ".join(lines), reward={"outcome": outcome}, terminated=True, info=info, failure=failure
        )

    # ---- the scripted expert

    def demonstration(self, task: Task, rng: random.Random, *, expert: Expert = PERFECT) -> list[str]:
        """View the file the gold patch changes, make its edits, sometimes run the tests, submit.

        An imperfect expert errs at two repository skills, each with its own probability: finding the file
        (`wrong_file`: it reads another module of the package, finds nothing, and submits unchanged) and making the
        edit (`sloppy_edit`: its `old` text is retyped with the whitespace wrong, the edit fails, and it submits),
        or names the right module with a typo (`typo_path`: the view fails, its error names the file meant). With
        probability `recover` it goes on after such an error instead: it views the right file, or retypes the edit
        exactly. With `mask_errors` the erring calls are `Mistake`s: context for the recovery, not targets."""
        instance = self.repo_tasks.instance(task.id)
        edits = expert_edits(instance)
        path = edits[0][0]
        call = self.parser.format

        submit = call(ToolCall(name="submit", arguments={}))
        messages = []

        def err(action: ToolCall) -> bool:
            """Take an erring call; True when the expert then gives up."""
            messages.append(Mistake(call(action)) if expert.mask_errors else call(action))
            return not chance(expert.recover, rng)

        if chance(expert.wrong_file, rng):
            others = sorted(p for p in instance.repo if p.endswith(".py") and not is_test_path(p) and p != path)
            if others and err(ToolCall(name="view", arguments={"path": rng.choice(others)})):
                return [*messages, submit]
        typo = chance(expert.typo_path, rng) and mistype(path, instance.repo, rng)
        if typo and err(ToolCall(name="view", arguments={"path": typo})):
            return [*messages, submit]
        messages.append(call(ToolCall(name="view", arguments={"path": path})))
        if chance(expert.sloppy_edit, rng):  # the first edit, misquoted
            file, old, new = edits[0]
            bad = misquote(old, instance.repo[file])
            if err(ToolCall(name="edit", arguments={"path": file, "old": bad, "new": new})):
                return [*messages, submit]
        for file, old, new in edits:
            messages.append(call(ToolCall(name="edit", arguments={"path": file, "old": old, "new": new})))
        if rng.random() < 0.5:
            messages.append(call(ToolCall(name="run_tests", arguments={})))
        return [*messages, submit]


def expert_edits(instance: RepoInstance) -> list[tuple[str, str, str]]:
    """The gold patch as `edit` calls, (path, old, new): for each changed run of lines, the fewest whole lines
    around it that occur once in the file. Files the patch creates or deletes are not edits: ValueError."""
    from agentrl.tasks.repos.instance import apply_patch

    fixed = apply_patch(instance.repo, instance.patch)
    edits = []
    for path in sorted(p for p in set(instance.repo) | set(fixed) if instance.repo.get(p) != fixed.get(p)):
        if path not in instance.repo or path not in fixed:
            raise ValueError(f"{instance.instance_id}: the gold patch creates or deletes {path}; the expert only edits")
        a, b = instance.repo[path].splitlines(keepends=True), fixed[path].splitlines(keepends=True)
        text = instance.repo[path]
        for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
            if tag == "equal":
                continue
            for pad in range(len(a) + 1):
                lo, hi = max(i1 - pad, 0), min(i2 + pad, len(a))
                old = "".join(a[lo:hi])
                if old and text.count(old) == 1:
                    new = "".join(a[lo:i1] + b[j1:j2] + a[i2:hi])
                    edits.append((path, old.rstrip("\n"), new.rstrip("\n")))
                    break
    return edits


def closest_lines(old: str, text: str, cutoff: float = 0.6) -> tuple[int, str] | None:
    """The run of as many whole lines of `text` as `old` has that is most like `old` (difflib's ratio, at least
    `cutoff`), with the number of its first line (its first place, if that text occurs twice); None when none is
    that close, or when the search would be long (over 20,000 lines compared: a long `old` in a big file)."""
    lines = text_lines(text)
    k = old.count("\n") + 1
    if k > len(lines) or k * len(lines) > 20_000:
        return None
    runs: dict[str, int] = {}
    for i in range(len(lines) - k + 1):
        runs.setdefault("\n".join(lines[i : i + k]), i + 1)
    best = difflib.get_close_matches(old, list(runs), n=1, cutoff=cutoff)
    return (runs[best[0]], best[0]) if best else None


def text_lines(text: str) -> list[str]:
    """The lines of `text` as `view` shows them: `git_lines` (numbered as grep, sed and tracebacks do), without their
    ends (a CRLF's "\r" too)."""
    return [line.removesuffix("\n").removesuffix("\r") for line in git_lines(text)]


def line_ends(text: str, old: str, new: str) -> tuple[str, str]:
    """`edit`'s old and new for a file with CRLF line ends: `view` shows its lines without the "\r", so an `old`
    of several lines copied from it is written with "\n"; when that is not in the file, both take the file's
    line ends."""
    if "\r\n" in text and "\n" in old and "\r\n" not in old and old not in text:
        return old.replace("\n", "\r\n"), new.replace("\r\n", "\n").replace("\n", "\r\n")
    return old, new


def refusal(e: OSError | ValueError) -> str:
    """Why the sandbox refused a file request, in its own words (an OSError's without its "[Errno N]")."""
    return (e.strerror if isinstance(e, OSError) else None) or str(e)


def no_nul(text: str, what: str) -> None:
    """ToolError if `text`, bound for a program's command line, holds a NUL byte: no argument can (the sandbox would
    refuse the call)."""
    if "\0" in text:
        raise ToolError(f"{what} holds a NUL byte, which no command line can; give it without one")


def near_file(path: str, repo: Collection[str]) -> str | None:
    """The file of `repo` that a missing `path` most likely meant (difflib's closest, ratio at least 0.6)."""
    near = difflib.get_close_matches(path, sorted(repo), n=1, cutoff=0.6)
    return near[0] if near else None


def mistype(path: str, repo: Collection[str], rng: random.Random) -> str | None:
    """`path` with one slip in its file name (a letter dropped, doubled or swapped with the next), drawn from those
    missing from `repo` whose closest file is `path` again; None when no slip is."""
    head, _, name = path.rpartition("/")
    stem, dot, ext = name.partition(".")
    slips = {stem[:i] + stem[i + 1 :] for i in range(len(stem))}  # dropped
    slips |= {stem[:i] + stem[i] + stem[i:] for i in range(len(stem))}  # doubled
    slips |= {stem[:i] + stem[i + 1] + stem[i] + stem[i + 2 :] for i in range(len(stem) - 1)}  # swapped
    typos = sorted(
        t for s in slips if s and (t := f"{head}/{s}{dot}{ext}".lstrip("/")) not in repo and near_file(t, repo) == path
    )
    return rng.choice(typos) if typos else None


def misquote(old: str, text: str) -> str:
    """`old` retyped with its whitespace wrong, so that it is in `text` no more: its indentation dropped, else
    spaces doubled after commas, else a space put before its first line's end."""
    for candidate in ("\n".join(line.lstrip() for line in old.split("\n")), old.replace(", ", ",  ")):
        if candidate != old and candidate not in text:
            return candidate
    first, _, rest = old.partition("\n")
    return f"{first} \n{rest}" if rest else f"{first} "
