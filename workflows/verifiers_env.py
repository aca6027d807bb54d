"""`verifiers` environments (prime-rl's environment layer, v1 API) as workflows, unchanged.

    workflow = VerifiersWorkflow("examples/verifiers_envs/calculator_tools.py:load_environment",
                                 gconfig, tokenizer, timeout_s=300)
    items = load_verifiers_items("examples/verifiers_envs/calculator_tools.py:load_environment",
                                 n=64, split="train")

verifiers pins openai<3, so it runs in its own venv (`bash scripts/install_verifiers.sh`,
default `.venv-verifiers`): each episode is one run of `workflows/verifiers_runner.py` there, a
`ProgramWorkflow` program. The runner plays the environment's own loop (its harness, turns,
tool servers) with its model client pointed at this episode's gateway session, so every model
call is recorded token-in/token-out; it scores the episode with the environment's own rewards
and prints them as its last stdout line, which becomes the trajectories' reward. The data
items are the environment's own tasks (`load_verifiers_items`, the runner's `items` mode).

Never a silent zero: a bad env spec, a rubric that raises, a harness or tool server that fails
or a runner past its timeout exit non-zero, and the episode fails with the runner's message
(the executor excludes and counts it).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any, Optional

from transformers import PreTrainedTokenizerBase

from areal_like.api import GenerationHyperparameters
from areal_like.utils import stats_tracker
from workflows.program import ProgramError, ProgramRun, ProgramWorkflow

DEFAULT_VENV = ".venv-verifiers"
RUNNER = Path(__file__).resolve().with_name("verifiers_runner.py")
REPO_ROOT = Path(__file__).resolve().parents[1]
ITEMS_TIMEOUT_S = 300.0
STDERR_TAIL = 2000


class VerifiersVenvMissing(FileNotFoundError):
    """The verifiers venv is not there (the message says how to install it)."""


def resolve_verifiers_python(venv: str | os.PathLike[str] = DEFAULT_VENV) -> Path:
    """`<venv>/bin/python`; a relative venv is looked up in the CWD, then the repo root."""
    path = Path(venv)
    candidates = [path] if path.is_absolute() else [Path.cwd() / path, REPO_ROOT / path]
    candidates = list(dict.fromkeys(candidates))
    for candidate in candidates:
        python = candidate / "bin" / "python"
        if python.exists():
            return python
    raise VerifiersVenvMissing(
        f"verifiers venv {str(venv)!r} not found (looked in: "
        f"{', '.join(str(c) for c in candidates)}); install it with "
        f"`bash scripts/install_verifiers.sh {venv}`")


def _resolve_spec(env_spec: str) -> tuple[str, dict[str, str]]:
    """The spec with a file made absolute (the runner runs in a fresh work directory), and the
    environment that makes a module spec importable from the CWD there."""
    target, sep, name = env_spec.rpartition(":")
    if not sep or not target or not name:
        raise ValueError(f"env spec {env_spec!r}: expected 'path/to/file.py:function' or "
                         f"'module:function'")
    if not target.endswith(".py"):
        path = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)
        return env_spec, {"PYTHONPATH": path}
    file = Path(target)
    if not file.is_absolute():  # relative to the CWD, else to the repo root
        file = next((f for f in (Path.cwd() / file, REPO_ROOT / file) if f.is_file()),
                    Path.cwd() / file)
    # a missing file is left to the runner: the episode fails naming the spec
    return f"{file.resolve()}:{name}", {}


def parse_result(stdout: str) -> dict[str, Any]:
    """The runner's result: the JSON object on its last non-empty stdout line."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    try:
        result = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        result = None
    if not isinstance(result, dict) or "reward" not in result:
        last = lines[-1] if lines else ""
        raise ProgramError(f"the verifiers runner's last stdout line is not its result "
                           f"(a JSON object with a 'reward'): {last[-STDERR_TAIL:]!r}")
    return result


def _reward(data: dict[str, Any], run: ProgramRun) -> Optional[float]:
    result = parse_result(run.stdout)
    # the environment's own metrics and turn count, beside the reward in the run's stats
    metrics = result.get("metrics")
    named = [("turns", result.get("turns")), *(metrics.items() if isinstance(metrics, dict)
                                              else [])]
    numbers = {f"verifiers/{name}": value for name, value in named
               if isinstance(value, (int, float)) and not isinstance(value, bool)}
    stats_tracker.scalar(**numbers)
    # not a number (null, a string) is refused by ProgramWorkflow with the value it got
    reward: Optional[float] = result["reward"]
    return reward


class VerifiersWorkflow(ProgramWorkflow):
    """`gconfig.n_samples` episodes of the verifiers environment `env_spec` per data item (a
    task of that environment, see `load_verifiers_items`), each one runner process with its
    own gateway session; a group of rows with one `group_id`.

    `env_spec`: `path/to/file.py:function` or `module:function`, the function returning a
    `verifiers.v1.Env`. `timeout_s` bounds an episode: the runner stops its environment
    (its processes too) a little before it, then its process group is killed."""

    def __init__(self, env_spec: str, gconfig: GenerationHyperparameters,
                 tokenizer: PreTrainedTokenizerBase | str, venv: str = DEFAULT_VENV,
                 timeout_s: float = 300.0, turn_discount: float = 1.0,
                 export_style: str = "concat", env: Optional[dict[str, str]] = None,
                 gateway_host: str = "127.0.0.1") -> None:
        if timeout_s <= 0:
            raise ValueError(f"VerifiersWorkflow: timeout_s={timeout_s!r} must be > 0")
        self.env_spec = env_spec
        python = resolve_verifiers_python(venv)
        spec, spec_env = _resolve_spec(env_spec)
        inner_timeout = timeout_s - min(30.0, timeout_s / 4)  # time left to clean up
        command = [str(python), str(RUNNER), "episode", spec, "--timeout", f"{inner_timeout:g}"]
        super().__init__(command, _reward, gconfig, tokenizer, timeout_s=timeout_s,
                         turn_discount=turn_discount, export_style=export_style,
                         env={**spec_env, **(env or {})}, gateway_host=gateway_host)


def load_verifiers_items(env_spec: str, n: int = 0, split: str = "train",
                         venv: str = DEFAULT_VENV,
                         timeout_s: float = ITEMS_TIMEOUT_S) -> list[dict[str, Any]]:
    """The environment's own tasks (at most `n`; 0: all), each its task data as a dict: the
    data items `VerifiersWorkflow` plays."""
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r}: expected 'train' or 'eval'")
    python = resolve_verifiers_python(venv)
    spec, spec_env = _resolve_spec(env_spec)
    try:
        proc = subprocess.run(
            [str(python), str(RUNNER), "items", spec, "--n", str(n), "--split", split],
            env={**os.environ, **spec_env}, stdin=subprocess.DEVNULL, capture_output=True,
            text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"loading the items of verifiers env {env_spec!r} took over "
                           f"{timeout_s:g} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"loading the items of verifiers env {env_spec!r} failed (exit "
                           f"{proc.returncode}): {proc.stderr[-STDERR_TAIL:].strip()}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
