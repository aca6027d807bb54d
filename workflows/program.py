"""An agent program we do not rewrite, as a workflow: any command (a Python script, a shell
loop, a program in another language) that talks to a model through the OpenAI or Anthropic
API, run once per episode against the agent gateway.

    workflow = ProgramWorkflow(["python", "agent.py"], verifier="my_task:score", gconfig=...,
                               tokenizer=..., timeout_s=120)

Each episode gets a gateway session and a fresh work directory; the program runs there, in a
process group of its own, with `OPENAI_BASE_URL` / `OPENAI_API_KEY` and `ANTHROPIC_BASE_URL` /
`ANTHROPIC_API_KEY` (the session: the official SDKs read them as they are),
`AREAL_LIKE_ITEM` (the data item as JSON) and `AREAL_LIKE_WORK_DIR` in its environment. When it
exits, its session is closed (later calls are refused and counted), `verifier(item, run)` reads
its reward from the run (exit code, stdout, stderr, the files it wrote), and the session's
calls become the episode's trajectories.

Never a silent zero: a program that exits non-zero (unless `check_exit=False`), outlives
`timeout_s` (its process group is killed), makes no model call, or whose verifier raises or
returns no number fails the episode with the reason; the executor excludes and counts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import shutil
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from tensordict import TensorDict
from transformers import PreTrainedTokenizerBase

from areal_like.api import GenerationHyperparameters, InferenceEngine, RolloutWorkflow
from areal_like.utils import stats_tracker
from areal_like.utils.batching import concat_padded
from areal_like.utils.imports import load_object
from workflows.common import load_tokenizer, stable_id
from workflows.gateway import AgentGateway

TAIL_CHARS = 2000  # of a failed program's stderr, in the episode's error


class ProgramError(RuntimeError):
    """The agent program failed its episode (the message says how)."""


@dataclass
class ProgramRun:
    """What a verifier reads of one run of the program."""

    exit_code: int
    stdout: str
    stderr: str
    work_dir: Path
    n_calls: int  # model calls the session answered

    def read(self, name: str) -> str:
        """A file the program wrote in its work directory."""
        return (self.work_dir / name).read_text()


Verifier = Callable[[dict[str, Any], ProgramRun], Optional[float]]


def _argv(command: str | Sequence[str]) -> list[str]:
    argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
    if not argv or not argv[0]:
        raise ValueError("ProgramWorkflow: an empty command")
    found = shutil.which(argv[0]) or (os.access(argv[0], os.X_OK) and argv[0])
    if not found:
        raise ValueError(f"ProgramWorkflow: program {argv[0]!r} not found (not on PATH, "
                         f"not an executable file)")
    return argv


class ProgramWorkflow(RolloutWorkflow):
    """`gconfig.n_samples` runs of the program per data item, concurrently, one gateway
    session each; a group of rows with one `group_id` (see the module doc)."""

    def __init__(self, command: str | Sequence[str], verifier: Verifier | str,
                 gconfig: GenerationHyperparameters,
                 tokenizer: PreTrainedTokenizerBase | str, timeout_s: float = 300.0,
                 check_exit: bool = True, turn_discount: float = 1.0,
                 export_style: str = "concat", env: Optional[dict[str, str]] = None,
                 gateway_host: str = "127.0.0.1") -> None:
        if timeout_s <= 0:
            raise ValueError(f"ProgramWorkflow: timeout_s={timeout_s!r} must be > 0")
        if export_style not in ("concat", "individual"):
            raise ValueError(f"ProgramWorkflow: export_style={export_style!r}: expected "
                             f"'concat' or 'individual'")
        self.argv = _argv(command)
        self.verifier: Verifier = (load_object(verifier, "ProgramWorkflow.verifier")
                                   if isinstance(verifier, str) else verifier)
        self.gconfig = gconfig
        self.tokenizer = load_tokenizer(tokenizer)
        self.timeout_s, self.check_exit = timeout_s, check_exit
        self.turn_discount, self.export_style = turn_discount, export_style
        self.env = dict(env or {})
        self.gateway_host = gateway_host
        self.gateway: Optional[AgentGateway] = None
        self._starting: Optional[asyncio.Task[str]] = None

    async def _gateway(self, engine: InferenceEngine) -> AgentGateway:
        """The workflow's gateway, started on this loop at the first episode."""
        if self.gateway is None:
            gateway = AgentGateway(engine, self.tokenizer, self.gconfig.new(n_samples=1),
                                   host=self.gateway_host)
            self._starting = asyncio.ensure_future(gateway.start())
            self.gateway = gateway
        if self._starting is not None:
            await asyncio.shield(self._starting)  # concurrent first episodes wait for it
        return self.gateway

    async def aclose(self) -> None:
        """Stop the gateway (the workflow can start another at its next episode)."""
        if self.gateway is not None:
            await self.gateway.stop()
            self.gateway, self._starting = None, None

    async def _run(self, env: dict[str, str], work_dir: Path) -> tuple[int, str, str]:
        """(exit code, stdout, stderr) of one run of the program."""
        proc = await asyncio.create_subprocess_exec(
            *self.argv, cwd=work_dir, env=env, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            start_new_session=True)
        try:
            out, err = await asyncio.wait_for(proc.communicate(), self.timeout_s)
        except asyncio.TimeoutError:
            raise ProgramError(f"program {shlex.join(self.argv)} still ran after "
                               f"timeout_s={self.timeout_s:g} s: its process group was "
                               f"killed") from None
        finally:  # the program and whatever it left running
            with contextlib.suppress(ProcessLookupError):  # the group is gone already
                os.killpg(proc.pid, signal.SIGKILL)
            if proc.returncode is None:
                await proc.wait()
        assert proc.returncode is not None
        return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")

    async def _episode(self, engine: InferenceEngine, data: dict[str, Any],
                       group_id: int) -> TensorDict:
        gateway = await self._gateway(engine)
        session = gateway.open_session()
        env = {**os.environ, **self.env,
               "OPENAI_BASE_URL": gateway.session_url(session), "OPENAI_API_KEY": session.key,
               "ANTHROPIC_BASE_URL": gateway.session_root(session),
               "ANTHROPIC_API_KEY": session.key,
               "AREAL_LIKE_ITEM": json.dumps(data, default=str)}
        with tempfile.TemporaryDirectory(prefix="areal_like_program_") as tmp:
            work_dir = Path(tmp)
            env["AREAL_LIKE_WORK_DIR"] = str(work_dir)
            try:
                code, out, err = await self._run(env, work_dir)
            finally:
                client = await gateway.close_session(session.key)
            run = ProgramRun(code, out, err, work_dir, len(client.completions))
            stats_tracker.scalar(**{"program/calls": float(run.n_calls),
                                    "program/invalid_tool_calls":
                                        float(session.invalid_tool_calls)})
            what = f"program {shlex.join(self.argv)}"
            if self.check_exit and run.exit_code != 0:
                raise ProgramError(f"{what} exited with code {run.exit_code}; the end of its "
                                   f"stderr:\n{run.stderr[-TAIL_CHARS:]}")
            if not client.completions:
                raise ProgramError(f"{what} made no model call (exit code {run.exit_code}; "
                                   f"stderr: {run.stderr[-TAIL_CHARS:]!r})")
            reward = self.verifier(data, run)
        if reward is None or not isinstance(reward, (int, float)):
            raise ProgramError(f"the verifier gave {reward!r} for a run of {what}: expected a "
                               f"number (the episode is not trained)")
        client.set_final_reward(float(reward))
        client.apply_reward_discount(self.turn_discount)
        return client.export_batch(self.export_style, group_id=group_id)

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> TensorDict:
        group_id = stable_id(data.get("id", json.dumps(data, sort_keys=True, default=str)))
        rows = await asyncio.gather(*[self._episode(engine, data, group_id)
                                      for _ in range(self.gconfig.n_samples)])
        return concat_padded(list(rows))
