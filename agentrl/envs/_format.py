"""How sandbox results read to the agent."""

from agentrl.env.tools import ToolOutput
from agentrl.sandbox import ExecResult


def describe_run(r: ExecResult) -> str:
    """Status line, then stdout and stderr (empty streams left out)."""
    if r.status == "ok":
        head = "exit code 0"
    elif r.exit_code is not None:
        head = f"exit code {r.exit_code}"
    else:
        head = {
            "timeout": "killed: time limit",
            "oom": "killed: out of memory",
            "output_limit": "killed: too much output",
        }.get(r.status, f"killed by signal {r.signal}")
    parts = [head + (" (output truncated)" if r.truncated else "")]
    if r.session_reset:
        parts.append("(the interpreter restarted: earlier variables are gone)")
    if r.stdout:
        parts.append(f"stdout:\n{r.stdout}")
    if r.stderr:
        parts.append(f"stderr:\n{r.stderr}")
    return "\n".join(parts)


def run_output(r: ExecResult) -> ToolOutput:
    """A tool's result for a sandbox run: its description, and the run itself for the episode's record."""
    return ToolOutput(content=describe_run(r), run=r)
