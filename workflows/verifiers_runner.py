"""Run a `verifiers` (v1) environment unchanged, from the verifiers venv's Python.

    python verifiers_runner.py items ENV_SPEC [--n N] [--split train|eval]
    python verifiers_runner.py episode ENV_SPEC [--timeout S]

ENV_SPEC is `path/to/file.py:function` or `module:function`, the function returning a
`verifiers.v1.Env` (it gets `split=` when it takes one). `items` prints the environment's own
tasks as JSONL, each its `TaskData` as JSON. `episode` rebuilds the task from the item in
`AREAL_LIKE_ITEM`, plays ONE episode of the environment's own loop (`Env.serving()` +
`Env.run_slot`, as `vf-eval` does: its harness, turns and tool servers) against the model at
`OPENAI_BASE_URL` (key `OPENAI_API_KEY`, model "policy"), scores it with the environment's own
rewards, and prints as its last stdout line `{"reward": .., "metrics": {..}, "turns": ..}`.

Standalone on purpose (stdlib + verifiers only): verifiers pins openai<3, so it lives in its
own venv (scripts/install_verifiers.sh). Any failure exits non-zero naming the spec; a failed
episode never prints a reward.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, NoReturn

STARTED = time.monotonic()  # --timeout counts from here: verifiers' import takes seconds
EXIT_SPEC, EXIT_EPISODE, EXIT_TIMEOUT = 2, 3, 4


def fail(code: int, message: str) -> NoReturn:
    print(f"verifiers_runner: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def _load_function(spec: str) -> Callable[..., Any]:
    """The environment function named by `spec`. A file is imported as a top-level module from
    its folder, which also goes on PYTHONPATH: verifiers imports tasksets by id and starts
    tool servers as `python -m <module>` in subprocesses."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        fail(EXIT_SPEC, f"env spec {spec!r}: expected 'path/to/file.py:function' or "
                        f"'module:function'")
    if target.endswith(".py"):
        path = Path(target).resolve()
        if not path.is_file():
            fail(EXIT_SPEC, f"env spec {spec!r}: no file {str(path)!r}")
        folder = str(path.parent)
        sys.path.insert(0, folder)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (folder, os.environ.get("PYTHONPATH", "")) if p)
        module_name = path.stem
    else:
        module_name = target
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure is the spec's
        fail(EXIT_SPEC, f"env spec {spec!r}: importing {module_name!r} failed: "
                        f"{type(e).__name__}: {e}")
    function = getattr(module, name, None)
    if not callable(function):
        fail(EXIT_SPEC, f"env spec {spec!r}: {module_name!r} has no function {name!r}")
    return function


def load_env(spec: str, split: str | None = None) -> Any:
    function = _load_function(spec)  # first: a bad spec fails before verifiers' slow import
    import verifiers.v1 as vf

    params = inspect.signature(function).parameters
    takes_split = "split" in params or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if split is not None and split != "train" and not takes_split:
        fail(EXIT_SPEC, f"env spec {spec!r}: no {split!r} split (its function takes no "
                        f"`split` argument)")
    try:
        env = function(split=split) if split is not None and takes_split else function()
    except Exception as e:  # noqa: BLE001 - the environment's own construction failed
        fail(EXIT_SPEC, f"env spec {spec!r}: building the environment failed: "
                        f"{type(e).__name__}: {e}")
    if not isinstance(env, vf.Env):
        fail(EXIT_SPEC, f"env spec {spec!r} returned {type(env).__name__}, not a "
                        f"verifiers.v1.Env")
    return env


def print_items(spec: str, n: int, split: str) -> None:
    env = load_env(spec, split)
    taskset = env.taskset.take(n) if n > 0 else env.taskset
    if not taskset.bounded:
        fail(EXIT_SPEC, f"env spec {spec!r}: its taskset is infinite; pass --n")
    for task in taskset:
        print(json.dumps(task.data.model_dump(mode="json", exclude_defaults=True)))


def _errors(episode: Any) -> list[str]:
    found = [f"{e.type}: {e.message}" for e in episode.errors]
    for trace in episode.traces:
        found += [f"{e.type}: {e.message}" for e in trace.errors]
    return found


async def play(spec: str, item: dict[str, Any], timeout_s: float | None) -> dict[str, Any]:
    import verifiers.v1 as vf

    env = load_env(spec)
    task_cls = type(env.taskset).task_type()
    try:
        task = task_cls(task_cls.data_type().model_validate(item), env.taskset.config.task)
    except Exception as e:  # noqa: BLE001 - pydantic's message names the bad field
        fail(EXIT_SPEC, f"env spec {spec!r}: the item is not a {task_cls.__name__} task: {e}")
    ctx = vf.ModelContext(
        model="policy",
        client=vf.EvalClientConfig(base_url=os.environ["OPENAI_BASE_URL"],
                                   api_key_var="OPENAI_API_KEY"),
        sampling=vf.SamplingConfig())  # the gateway's generation settings rule
    left = None if timeout_s is None else max(0.0, timeout_s - (time.monotonic() - STARTED))
    try:
        async with asyncio.timeout(left), env.serving():
            (slot,) = env.slots(task, 1)
            episode = await env.run_slot(slot, ctx)
    except TimeoutError:
        fail(EXIT_TIMEOUT, f"env spec {spec!r}: the episode ran past --timeout {timeout_s:g} s")
    if not episode.ok:
        fail(EXIT_EPISODE, f"env spec {spec!r}: the episode failed: "
                           + "; ".join(_errors(episode) or ["(no error recorded)"]))
    trained = [t for t in episode.traces if t.agent.trainable]
    if len(trained) != 1:
        fail(EXIT_EPISODE, f"env spec {spec!r}: {len(trained)} trainable traces in the episode; "
                           f"one is supported")
    (trace,) = trained
    unscored = [name for name, r in trace.rewards.items() if r is None]
    if unscored or not trace.rewards:
        fail(EXIT_EPISODE, f"env spec {spec!r}: rewards not scored: {unscored or 'none defined'}")
    reward = float(trace.reward)
    if not math.isfinite(reward):
        fail(EXIT_EPISODE, f"env spec {spec!r}: the rubric gave reward {reward}")
    return {"reward": reward, "metrics": {k: v for k, v in trace.metrics.items()},
            "turns": int(trace.num_turns), "stop": trace.stop_condition}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    items = sub.add_parser("items", help="print the environment's tasks as JSONL")
    items.add_argument("env_spec")
    items.add_argument("--n", type=int, default=0, help="at most N tasks (0: all)")
    items.add_argument("--split", choices=("train", "eval"), default="train")
    episode = sub.add_parser("episode", help="one episode of the item in AREAL_LIKE_ITEM")
    episode.add_argument("env_spec")
    episode.add_argument("--timeout", type=float, default=None,
                         help="seconds from start before the episode is stopped (its "
                              "processes too)")
    args = parser.parse_args(argv)
    # verifiers logs through stdlib logging; warnings and errors reach our stderr tail
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.mode == "items":
        print_items(args.env_spec, args.n, args.split)
        return
    for name in ("AREAL_LIKE_ITEM", "OPENAI_BASE_URL", "OPENAI_API_KEY"):
        if name not in os.environ:
            fail(EXIT_SPEC, f"env spec {args.env_spec!r}: {name} is not set")
    try:
        item = json.loads(os.environ["AREAL_LIKE_ITEM"])
    except json.JSONDecodeError as e:
        fail(EXIT_SPEC, f"env spec {args.env_spec!r}: AREAL_LIKE_ITEM is not JSON: {e}")
    # verifiers' chat harness runs through `uv` (installed beside this Python); never let uv
    # download an interpreter
    os.environ["PATH"] = os.pathsep.join((str(Path(sys.executable).parent),
                                          os.environ.get("PATH", "")))
    os.environ.setdefault("UV_PYTHON_DOWNLOADS", "never")
    result = asyncio.run(play(args.env_spec, item, args.timeout))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
