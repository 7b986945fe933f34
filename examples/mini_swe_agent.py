"""A mini-SWE-agent-style bash loop, written with the OpenAI SDK, trained by agentrl on `repo_fix`.

    agentrl train --env examples.mini_swe_agent:mini_swe

Each episode, agentrl hands `run` the task, an `openai.AsyncOpenAI` client whose every call is recorded token for
token into the episode's trajectory (a session of the run's gateway), and the sandbox holding the repository.
When `run` returns, `repo_fix` grades the repository as the agent left it, exactly as its own loop grades a
submission: what `run` returns does not count. This file's Python runs on the driver's host, not in a sandbox;
only the commands it sends through `sandbox.run` run in one.
"""

import json

import agentrl

SYSTEM = "Fix the issue in the repository at /work/repo. Run bash commands with the bash tool; stop when it is fixed."
BASH = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a bash command in the repository and see its exit status and output.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    },
}


async def run(task: agentrl.AgentTask, client, sandbox: agentrl.AgentSandbox, steps: int = 6) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.prompt}]
    for _ in range(steps):
        reply = await client.chat.completions.create(model=agentrl.MODEL, messages=messages, tools=[BASH])
        message = reply.choices[0].message
        messages.append(message)  # the reply as it came: the gateway appends the next turn token-exactly
        if not message.tool_calls:
            return  # done: the repository is graded as it stands
        for call in message.tool_calls:
            command = json.loads(call.function.arguments).get("command", "")
            out = await sandbox.run(command)
            result = f"exit status {out.exit_code}\n{out.stdout}{out.stderr}"[-4000:]
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})


agentrl.register("mini_swe", agent=run, env="repo_fix", tasks="repos", max_turns=6)
