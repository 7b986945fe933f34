"""An agent program the evaluation tests register: importing this module (as the env workers do,
`eval_agents:NAME`) registers it. It grades itself: it solves the procedural tasks of even number and
raises on the others, as an agent with a bug on the problems it cannot solve would."""

from __future__ import annotations

import agentrl


def solves(task_id: str) -> bool:
    return int(task_id.rsplit("/", 1)[-1]) % 2 == 0


async def raises_when_stuck(task, client, sandbox):
    await client.chat.completions.create(model="policy", messages=list(task.messages), max_tokens=4)
    if not solves(task.id):
        raise RuntimeError("the agent's own bug")
    return 1.0


agentrl.register("raises_when_stuck", agent=raises_when_stuck, tasks="procedural:levels=1;families=lists")
