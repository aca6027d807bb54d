"""A tool that runs model-written Python in the code sandbox (`areal_like/utils/sandbox.py`:
bubblewrap, no network, no file outside its directory, CPU / memory / process / wall-clock
limits), for `ToolRegistry` agents:

    registry.register(python_tool(Sandbox(SandboxLimits(wall_s=10))), name="python")

The model sees the run's exit code, stdout and stderr (its end); code killed at a limit is a
failed tool call saying so, and the episode goes on.
"""

from __future__ import annotations

from typing import Any

from areal_like.utils.sandbox import Sandbox
from workflows.tools import ToolFn

STDERR_TAIL = 2000  # characters of stderr the model sees


class SandboxLimitError(RuntimeError):
    """The code was killed at the sandbox's wall-clock limit."""


def python_tool(sandbox: Sandbox) -> ToolFn:
    """The `python(code)` tool. The sandbox is checked here: a machine without bubblewrap
    fails when the tool is made, not in every episode."""
    sandbox.check()

    async def python(code: str) -> dict[str, Any]:
        """Run Python 3 code in a sandbox; its exit code, stdout and stderr."""
        if not isinstance(code, str):
            raise TypeError(f"'code' must be a string, got {type(code).__name__}")
        result = await sandbox.run_python(code)
        if result.timed_out:  # not a TimeoutError: the registry reads that as its own bound
            raise SandboxLimitError(f"the code still ran after {sandbox.limits.wall_s:g} s "
                                    f"and was killed")
        return {"exit_code": result.exit_code, "stdout": result.stdout,
                "stderr": result.stderr[-STDERR_TAIL:]}

    return python
