"""Evaluate a model folder on a config's held-out split, outside a training run.

    areal-like eval MODEL [--config FILE] [key=value ...] [--out FILE]

MODEL is a Hugging Face folder (a run's `final/`, a `weights/v<N>/`, a warm start). FILE
defaults to the `config.yaml` of the run MODEL lies in (`<run dir>/final` -> `<run
dir>/config.yaml`). The numbers are those in-training evaluation logs, by the same code:
`valid_dataset`'s first `evaluation.n_prompts` items (after the same prompt-length limit),
the same verifier (or `reward.fn` / `reward.remote_rm_url`), greedy `eval/accuracy` and
`eval/reward`, `eval/pass@k` when `evaluation.pass_k` > 1. Servers are started on MODEL
(`server.*`; deterministic by default, so a run's greedy numbers repeat exactly); the
metrics are printed and written as JSON to FILE (default `<MODEL>.eval.json` beside MODEL).
Recipes whose evaluation uses a workflow of their own (multi-turn, agent) are evaluated
with the single-turn greedy workflow here. A reward-model folder (`recipes.rm`'s final/)
is evaluated by pair accuracy on the config's `valid_pairs` instead (`evaluate_rm.py`).
`areal-like eval` registers the recipes' schemas
that a recipe YAML's defaults list names (this layer may not import `recipes`).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from areal_like.api.config import BaseExperimentConfig
from areal_like.api.config_loader import ConfigError, load_launch_config
from areal_like.data.prompt_limits import load_tokenizer
from areal_like.rewards.reward_executor import RewardExecutor
from areal_like.rewards.rm_model import is_reward_model_folder
from areal_like.rollout.evaluation import evaluate
from areal_like.runtime.evaluate_rm import evaluate_reward_model, valid_pairs_config
from areal_like.runtime.held_out import held_out_items
from areal_like.runtime.recipe_args import set_threads, split_args

EVAL_TIMEOUT_S = 3600.0  # all episodes together; each request has rollout.client.request_timeout


def load_eval_config(model: Path, argv: list[str]) -> tuple[BaseExperimentConfig, Path]:
    """The config (with `model.path` = MODEL) and where it came from."""
    if not (model / "config.json").is_file():
        raise ConfigError(f"{model} is not a Hugging Face model folder (no config.json)")
    has_config = any(a.split("=", 1)[0] in ("--config", "--config-name", "-cn") for a in argv)
    config_path, overrides = split_args(argv, "")
    if not has_config:
        config_path = model.resolve().parent / "config.yaml"
        if not config_path.is_file():
            raise ConfigError(f"no --config FILE given and {model} is not in a run folder "
                              f"({config_path} does not exist): give the YAML of the task to "
                              f"evaluate on, e.g. --config recipes/conf/grpo_addition.yaml")
    overrides = [*overrides, f"model.path={model}", "rollout.server_addrs=[]"]
    return load_launch_config(BaseExperimentConfig, config_path, overrides), config_path


def evaluate_model(config: BaseExperimentConfig) -> dict[str, float]:
    """Start servers on `config.model.path`, evaluate, stop them; the `eval/*` metrics."""
    from areal_like.rollout.controller import RolloutController
    from engines.fleet.client import RemoteInferenceEngine
    from engines.fleet.launch import InferenceFleet

    tokenizer = load_tokenizer(config.model)
    valid = f"valid_dataset (type={config.valid_dataset.type})"
    try:
        items, reward_fn = held_out_items(config, tokenizer)
    except (ValueError, TypeError, KeyError) as e:  # what the launcher's preflight refuses:
        raise ConfigError(f"{valid}: {e}") from e  # a size, task_kwargs, prompt lengths
    if not items:
        raise ConfigError(f"{valid} has no items to evaluate on")
    rewards = RewardExecutor(config.reward)
    rewards.check(reward_fn, items[0])  # a broken verifier fails before servers start
    log_dir = Path(tempfile.mkdtemp(prefix="areal_like_eval_"))
    fleet = InferenceFleet(config.model.path, config.server, api_key=config.rollout.client.api_key,
                           log_dir=log_dir)
    print(f"starting {config.server.n_servers} SGLang server(s) on {config.model.path} "
          f"(logs in {log_dir})", flush=True)
    fleet.start()
    try:
        rollout = dataclasses.replace(config.rollout, server_addrs=list(fleet.addresses))
        controller = RolloutController(rollout, RemoteInferenceEngine(rollout), rewards=rewards)
        controller.initialize()
        try:
            ev = config.evaluation
            return evaluate(controller, items, reward_fn, tokenizer, config.gconfig, ev.pass_k,
                            ev.temperature, timeout=EVAL_TIMEOUT_S, pass_n=ev.pass_n)
        finally:
            controller.destroy()
    finally:
        fleet.stop()
        rewards.shutdown()


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    model, rest = Path(argv[0]), argv[1:]
    out: Optional[Path] = None
    if "--out" in rest:
        i = rest.index("--out")
        if i + 1 >= len(rest):
            print("config error: --out needs a file", file=sys.stderr)
            return 2
        out = Path(rest[i + 1])
        del rest[i:i + 2]
    try:
        config, config_path = load_eval_config(model, rest)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    set_threads(config)
    reward_model = is_reward_model_folder(str(model))
    try:
        if reward_model:  # pair accuracy, in this process: no servers
            pairs = valid_pairs_config(config, config_path, rest)
            metrics = evaluate_reward_model(model, pairs, config.evaluation.n_prompts,
                                            config.model.chat_template_kwargs)
        else:
            metrics = evaluate_model(config)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    out = out or model.resolve().parent / f"{model.resolve().name}.eval.json"
    record: dict[str, Any] = {"model": str(model.resolve()), "config": str(config_path),
                              **metrics}
    if not reward_model:
        record["valid_dataset"] = config.valid_dataset.type
    out.write_text(json.dumps(record, indent=1) + "\n")
    for key in sorted(metrics):
        print(f"{key}: {metrics[key]:.4f}", flush=True)
    print(f"metrics written to {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
