"""Envs the rollout tests register: importing this module (as the env workers do, `parking_envs:NAME`) registers
them."""

import asyncio

import agentrl
from agentrl.envs.code_sandbox import CodeSandboxEnv


class HoldsFromReset(CodeSandboxEnv):
    """Takes its sandbox at reset, as repo_fix does (it places the repository there): a parked episode holds one."""

    async def _reset(self, task):
        opening = await super()._reset(task)
        await self.sandbox()
        return opening


agentrl.register("holds_from_reset", HoldsFromReset, max_turns=4, tasks="procedural:levels=1;families=lists")


class CancelsItsStep(CodeSandboxEnv):
    """Its step raises CancelledError from its own code, as a timeout of its own can."""

    async def _step(self, action):
        raise asyncio.CancelledError("the env's own timeout")


agentrl.register("cancels_its_step", CancelsItsStep, max_turns=4, tasks="procedural:levels=1;families=lists")
