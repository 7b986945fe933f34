"""agentrl: reinforcement learning of LLM agents that call tools and run code."""

from agentrl.env.agents import MODEL, AgentSandbox, AgentTask
from agentrl.env.registry import Agent, make, register

__version__ = "0.1.0"
__all__ = ["MODEL", "Agent", "AgentSandbox", "AgentTask", "make", "register"]
