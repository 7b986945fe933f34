"""Agent programs (and an env) the agent-env tests register: importing this module (as the env workers do,
`agent_programs:NAME`) registers them. Each `run` is a plain OpenAI-SDK agent; which one plays a task is
`BEHAVIOUR[task.id]`, set by the test (the agents run in the test's own process, the driver)."""

from __future__ import annotations

import asyncio
import shlex

import agentrl
from agentrl.envs.code_sandbox import CodeSandboxEnv
from agentrl.tasks.registry import load_tasks
from agentrl.tasks.repos.instance import apply_patch

BEHAVIOUR: dict[str, str] = {}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a bash command in the repository.",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
        },
    }
]


async def ask(client, messages):
    r = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=12)
    return r.choices[0].message


async def scripted(task, client, sandbox):
    behaviour = BEHAVIOUR[task.id]
    if behaviour == "silent":
        return 1.0
    messages = list(task.messages)
    reply = await ask(client, messages)
    messages.append(reply)
    if behaviour == "raises":
        raise RuntimeError("the agent's own bug")
    if behaviour == "sleeps":
        await asyncio.sleep(60)
    if behaviour == "rewrites":
        await ask(client, [messages[0], {"role": "user", "content": "Summary so far: nothing done."}])
        return 1.0
    if behaviour == "expert":  # the gold patch, written through the sandbox (the agent knows it: a test's agent)
        instance = load_tasks("repos").instance(task.id)
        for path, text in apply_patch(instance.repo, instance.patch).items():
            if instance.repo.get(path) != text:
                ran = await sandbox.run(f"cat > {shlex.quote(path)} <<'AGENTRL_EOF'\n{text}AGENTRL_EOF")
                assert ran.exit_code == 0, ran
    ran = await sandbox.run("pwd && ls")
    messages.append({"role": "user", "content": ran.stdout})
    await ask(client, messages)  # a second turn, appended to the first
    return 0.0 if behaviour == "expert" else 1.0  # the env grades, whatever run returns


async def self_graded(task, client, sandbox):
    await ask(client, list(task.messages))
    ran = await sandbox.run("echo $((6 * 7))")
    return 0.5 if ran.stdout.strip() == "42" else "not a number"


agentrl.register("scripted_on_repo_fix", agent=scripted, env="repo_fix", tasks="repos", max_turns=8)
agentrl.register("self_graded", agent=self_graded, tasks="procedural:levels=1;families=lists")


class Forgetful(CodeSandboxEnv):
    """An env that declares it names its states, and names none after its first turn (an env's bug)."""

    names_states = True

    async def state_key(self) -> str:
        if self.turn:
            raise RuntimeError("lost track of the state")
        return "start"


agentrl.register("forgetful", Forgetful, max_turns=3)


class NanReward(CodeSandboxEnv):
    """An env whose reward comes out NaN (an env's bug: a score divided by zero tests)."""

    async def _step(self, action: str):
        result = await super()._step(action)
        result.reward_breakdown["score"] = float("nan")
        return result


agentrl.register("nan_reward", NanReward, max_turns=1)
