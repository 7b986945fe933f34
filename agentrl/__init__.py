"""agentrl: reinforcement learning of LLM agents that call tools and run code."""

__version__ = "0.1.0"
