"""agentrl: reinforcement learning of LLM agents that call tools and run code."""

from agentrl.env.registry import make, register

__version__ = "0.1.0"
__all__ = ["make", "register"]
