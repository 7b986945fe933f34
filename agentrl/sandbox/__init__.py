"""Sandboxes: locked-down places to run untrusted code, and a warm pool of them."""

from agentrl.sandbox.base import CallLimits, ExecResult, Sandbox, SandboxError, Status
from agentrl.sandbox.bwrap import BwrapSandbox, BwrapSandboxConfig
from agentrl.sandbox.config import SandboxConfig
from agentrl.sandbox.docker_sandbox import DockerSandbox, DockerSandboxConfig
from agentrl.sandbox.local import LocalSandbox, LocalSandboxConfig
from agentrl.sandbox.pool import SandboxPool

__all__ = [
    "BwrapSandbox",
    "BwrapSandboxConfig",
    "CallLimits",
    "DockerSandbox",
    "DockerSandboxConfig",
    "ExecResult",
    "LocalSandbox",
    "LocalSandboxConfig",
    "Sandbox",
    "SandboxConfig",
    "SandboxError",
    "SandboxPool",
    "Status",
]
