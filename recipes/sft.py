"""Supervised fine-tuning on a task's (prompt, answer) pairs with the FSDP2 engine.

    python -m recipes.sft [--config FILE] [key=value ...]     (or under torchrun)

Writes the final weights (+ tokenizer) as an HF folder to `<run dir>/final`, loadable by
transformers and SGLang: the main job uses it as the warm start of RL. Evaluates every
`evaluation.freq_steps`, checkpoints every `checkpoint.freq_steps` and, with
`checkpoint.recover=auto`, resumes after the last checkpoint.
"""

from __future__ import annotations

from areal_like.algorithms import SFTActor
from areal_like.api import SaveLoadMeta
from areal_like.data.loader import ItemLoader, head_items
from areal_like.data.prompt_limits import limit_prompt_length, load_tokenizer
from areal_like.data.sft import argmax_hits, build_sft_batch, greedy_exact_match
from areal_like.data.tasks import build_task
from areal_like.runtime.context import RunContext
from areal_like.runtime.dataset_steps import DatasetSteps
from areal_like.runtime.recipe_args import parse_recipe_args
from areal_like.utils.fast_exit import exit_now
from engines import FSDPEngine
from engines.fsdp.packing import shard_batch
from recipes.configs import SFTConfig


def main(argv: list[str] | None = None) -> None:
    config = parse_recipe_args(SFTConfig, "sft_addition.yaml", argv)
    run = RunContext(config, console_keys=["sft/train/nll/avg", "eval/accuracy",
                                              "timeperf/startup"])
    tokenizer = load_tokenizer(config.model)
    train, valid = config.train_dataset, config.valid_dataset
    train_items, n_long = limit_prompt_length(build_task(train, name="train_dataset").dataset,
                                              tokenizer, train, "train_dataset")
    valid_items, _ = limit_prompt_length(build_task(valid, name="valid_dataset").dataset,
                                         tokenizer, valid, "valid_dataset")
    engine = FSDPEngine(config.actor)
    engine.initialize()
    actor = SFTActor(engine)
    steps = DatasetSteps(config, run, engine)  # resumes after the last checkpoint
    loader = ItemLoader(train_items, train.batch_size, config.seed, shuffle=train.shuffle)
    batches = loader.forever(skip=steps.start)  # the batches not yet trained on
    eval_batch = build_sft_batch(head_items(valid_items, config.evaluation.n_prompts,
                                            valid.shuffle, valid.seed), tokenizer)

    def accuracy() -> dict[str, float]:
        local = shard_batch(eval_batch, run.data_parallel_rank, run.data_parallel_size,
                            width=run.balance_width)
        correct = greedy_exact_match(engine.forward(local, post_hook=argmax_hits), local)
        return {"eval/accuracy": run.global_mean(correct.float())}

    if steps.start == 0:
        run.log_step(0, {"data/train_long_prompts_dropped": n_long, **accuracy()})
    for step in steps.range("sft steps"):
        batch = build_sft_batch(next(batches), tokenizer)
        stats = actor.update(shard_batch(batch, run.data_parallel_rank, run.data_parallel_size,
                                         width=run.balance_width))
        steps.end(step, stats, accuracy)  # LR, evaluation when due, metrics, checkpoint
    steps.finish()
    engine.save(SaveLoadMeta(str(run.dir / "final"), weight_format="hf", tokenizer=tokenizer))
    if run.is_main:
        print(f"final model: {run.dir / 'final'}", flush=True)  # as the RL recipes say it
    run.close()


if __name__ == "__main__":
    main()
    exit_now()  # the run is over: skip the teardown of its imports (areal_like.utils.fast_exit)
