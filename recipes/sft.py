"""Supervised fine-tuning on a task's (prompt, answer) pairs with the FSDP2 engine.

    python -m recipes.sft [--config FILE] [key=value ...]     (or under torchrun)

Writes the final weights (+ tokenizer) as an HF folder to `<run dir>/final`, loadable by
transformers and SGLang: the main job uses it as the warm start of RL.
"""

from __future__ import annotations

import sys

from tqdm import tqdm
from transformers import AutoTokenizer

from areal_like.algorithms import SFTActor
from areal_like.api import SaveLoadMeta
from areal_like.data.loader import ItemLoader
from areal_like.data.packing import shard_batch
from areal_like.data.sft import argmax_hits, build_sft_batch, greedy_exact_match
from areal_like.data.tasks import build_task
from areal_like.runtime.cli import parse_recipe_args
from areal_like.runtime.context import RunContext
from engines import FSDPEngine
from recipes.configs import SFTConfig


def main(argv: list[str] | None = None) -> None:
    config = parse_recipe_args(SFTConfig, "sft_addition.yaml", argv)
    run = RunContext(config, console_keys=["sft/train/nll/avg", "eval/accuracy"])
    tokenizer = AutoTokenizer.from_pretrained(config.model.path)
    task, valid = build_task(config.train_dataset), build_task(config.valid_dataset)
    engine = FSDPEngine(config.actor)
    engine.initialize()
    actor = SFTActor(engine)
    loader = ItemLoader(task.dataset, config.batch_size, config.seed)
    batches = loader.forever()
    eval_batch = build_sft_batch(valid.dataset.to_list()[: config.evaluation.n_prompts], tokenizer)

    def accuracy() -> dict[str, float]:
        local = shard_batch(eval_batch, run.rank, run.world_size)
        correct = greedy_exact_match(engine.forward(local, post_hook=argmax_hits), local)
        return {"eval/accuracy": run.global_mean(correct.float())}

    run.log_step(0, accuracy())
    for step in tqdm(range(config.total_train_steps), desc="sft steps", disable=not run.is_main,
                     mininterval=5.0, file=sys.stderr):
        batch = build_sft_batch(next(batches), tokenizer)
        stats = actor.update(shard_batch(batch, run.rank, run.world_size))
        engine.step_lr_scheduler()
        if (step + 1) % config.eval_every == 0 or step + 1 == config.total_train_steps:
            stats |= accuracy()
        run.log_step(step + 1, stats)
    engine.save(SaveLoadMeta(str(run.dir / "final"), weight_format="hf", tokenizer=tokenizer))
    run.close()


if __name__ == "__main__":
    main()
