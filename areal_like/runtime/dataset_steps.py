"""The step loop of the recipes that train on a dataset without a fleet (`sft`, `rm`, `dpo`):
resume after the last checkpoint, step the LR schedule, evaluate every
`evaluation.freq_steps` and at the last step, log, checkpoint.

    steps = DatasetSteps(config, run, engine)
    batches = loader.forever(skip=steps.start)          # the batches not yet trained on
    if steps.start == 0:
        run.log_step(0, evaluate())
    for step in steps.range("sft steps"):
        stats = actor.update(...)
        steps.end(step, stats, evaluate)
    steps.finish()
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Callable

from areal_like.runtime.checkpoint import Checkpointer
from areal_like.runtime.context import RunContext
from areal_like.utils.progress import progress


class DatasetSteps:
    def __init__(self, config: Any, run: RunContext, engine: Any) -> None:
        self.config, self.run, self.engine = config, run, engine
        self.ckpt = Checkpointer(config.checkpoint, run.dir, run.rank)
        latest = self.ckpt.latest() if config.checkpoint.recover == "auto" else None
        self.start = self.ckpt.load(latest, engine)["step"] + 1 if latest is not None else 0

    def range(self, label: str) -> Iterator[int]:
        """The steps still to train, with the run's progress bar."""
        return iter(progress(range(self.start, self.config.total_train_steps), label,
                             enabled=self.run.is_main))

    def end(self, step: int, stats: dict[str, float],
            evaluate: Callable[[], dict[str, float]]) -> None:
        """After step `step`'s update: LR schedule, evaluation when due, metrics, checkpoint."""
        self.engine.step_lr_scheduler()
        last = step + 1 == self.config.total_train_steps
        freq = self.config.evaluation.freq_steps
        if freq and ((step + 1) % freq == 0 or last):
            stats = stats | evaluate()
        self.run.log_step(step + 1, stats)
        self.ckpt.commit_if_written(self.engine)  # an asynchronous save written since
        if self.ckpt.should_save(step, last):
            self.ckpt.save(step, self.engine, {})

    def finish(self) -> None:
        self.ckpt.commit(self.engine)  # a checkpoint still being written
