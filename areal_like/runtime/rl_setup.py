"""Everything around an RL recipe's loop: engines, fleet client, data, evaluation, checkpoints.

A recipe keeps only the algorithm in view:

    rl = RLSetup(config)
    for step in rl.steps():
        batch = rl.next_batch(workflow, should_accept)   # rank 0 rolls out, every rank trains
        ... actor.compute_logp / compute_advantages / update ...
        stats |= rl.push_weights(step)                   # pause -> load v+1 -> resume
        rl.end_step(step, stats)                         # evaluate, checkpoint, log
    rl.finish()
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterator
from typing import Any, Callable, Optional

from tensordict import TensorDict
from tqdm import tqdm
from transformers import AutoTokenizer

from areal_like.api import RolloutWorkflow
from areal_like.api.config import BaseExperimentConfig, TrainEngineConfig
from areal_like.data.loader import ItemLoader
from areal_like.data.tasks import build_task
from areal_like.runtime.checkpoint import Checkpointer
from areal_like.runtime.context import RunContext
from areal_like.runtime.evaluation import evaluate
from areal_like.runtime.recover import maybe_recover, save_checkpoint
from areal_like.runtime.weight_sync import push_weights
from areal_like.utils.plotting import plot_run
from engines import FSDPEngine, RemoteSGLangEngine

CONSOLE = ["actor/task_reward/avg", "eval/accuracy", "rollout/staleness_max", "timeperf/step"]


def start_engine(config: TrainEngineConfig) -> FSDPEngine:
    engine = FSDPEngine(config)
    engine.initialize()
    return engine


class RLSetup:
    """Per-process set-up of an RL run; rank 0 also owns the fleet client."""

    def __init__(self, config: BaseExperimentConfig,
                 eval_workflow: Optional[Callable[[], RolloutWorkflow]] = None) -> None:
        self.config = config
        self.run = RunContext(config, console_keys=CONSOLE)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model.path)
        self.task, self.valid = build_task(config.train_dataset), build_task(config.valid_dataset)
        self.actor_engine = start_engine(config.actor)
        self.rollout: Optional[RemoteSGLangEngine] = None
        if self.run.is_main:
            seed = config.seed if config.rollout.seed is None else config.rollout.seed
            self.rollout = RemoteSGLangEngine(dataclasses.replace(config.rollout, seed=seed))
            self.rollout.initialize()
        self.loader = ItemLoader(self.task.dataset, config.train_dataset.batch_size, config.seed)
        self.ckpt = Checkpointer(config.checkpoint, self.run.dir, self.run.rank)
        self.eval_items = self.valid.dataset.to_list()[: config.evaluation.n_prompts]
        self.eval_workflow = eval_workflow

    # ---- the loop ---------------------------------------------------------------------------
    def steps(self) -> Iterator[int]:
        """Training steps, resuming after the last checkpoint when `checkpoint.recover=auto`."""
        start = maybe_recover(self.ckpt, self.run, self.actor_engine, self.rollout)
        if start == 0:
            self.run.log_step(0, self.held_out())
        total = self.config.total_train_steps
        yield from tqdm(range(start, total), initial=start, total=total, desc="train steps",
                        disable=not self.run.is_main, mininterval=5.0, file=sys.stderr)

    def timing(self, name: str) -> contextlib.AbstractContextManager[None]:
        return self.run.timing(name)

    def next_batch(self, workflow: RolloutWorkflow,
                   should_accept: Optional[Callable[[TensorDict], bool]] = None) -> TensorDict:
        """The next consumer batch (waits only when rollout fell behind), this rank's share."""
        batch = (self.rollout.prepare_batch(self.loader, workflow, should_accept)
                 if self.rollout is not None else None)
        return self.run.broadcast_batch(batch, self.config.algorithm.group_size)

    def push_weights(self, step: int) -> dict[str, float]:
        """Export the trainer's weights as version step + 1 and load them on the fleet."""
        return push_weights(self.actor_engine, self.rollout, step + 1, self.run.weights_dir)

    def held_out(self) -> dict[str, float]:
        if self.rollout is None or not self.eval_items:
            return {}
        workflow = self.eval_workflow() if self.eval_workflow else None
        ev = self.config.evaluation
        return evaluate(self.rollout, self.eval_items, self.valid.reward_fn, self.tokenizer,
                        self.config.gconfig, ev.pass_k, ev.temperature, workflow=workflow,
                        pass_n=ev.pass_n)

    def end_step(self, step: int, stats: dict[str, Any],
                 extra_engines: tuple[Any, ...] = ()) -> None:
        """Step the LR schedules (actor and `extra_engines`), evaluate every
        `evaluation.freq_steps`, checkpoint every `checkpoint.freq_steps`, log the metrics."""
        self.actor_engine.step_lr_scheduler()
        for engine in extra_engines:
            engine.step_lr_scheduler()
        last = step + 1 == self.config.total_train_steps
        freq = self.config.evaluation.freq_steps
        if freq and ((step + 1) % freq == 0 or last):
            stats |= self.held_out()
        if self.ckpt.should_save(step, last):
            save_checkpoint(self.ckpt, step, self.actor_engine, self.rollout)
        self.run.log_step(step + 1, stats)

    def finish(self) -> None:
        """Print accuracy before -> after, write the curves PNG, release everything."""
        self.run.summarize("eval/accuracy")
        if self.run.metrics is not None and self.config.logging.plot:
            png = plot_run(self.run.metrics.jsonl_path, self.run.dir / "curves.png",
                           self.run.dir.name)
            print(f"curves: {png}", flush=True)
        if self.rollout is not None:
            self.rollout.destroy()
        self.run.close()
