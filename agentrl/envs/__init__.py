"""agentrl's built-in environments, registered as agentrl/code_sandbox-v0, agentrl/tool_use-v0, agentrl/humaneval-v0."""
