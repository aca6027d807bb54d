"""Direct preference optimisation: the policy trained on preference pairs, no reward model.

    python -m recipes.dpo [--config FILE] [key=value ...]     (or: areal-like run dpo)

The frozen reference's response log-probs are computed once for every pair before training
(the `ref` model, then released; with `actor.lora` the actor's own base with its adapters
off). Each step trains on `pairs.batch_size` pairs with `loss` (sigmoid DPO, label-smoothed,
or IPO). Every `evaluation.freq_steps`: the held-out pairs' accuracy by implicit reward
beta * (log pi - log ref), and the task's greedy exact match on `valid_dataset` (as the sft
recipe measures it). The final policy is written to `<run dir>/final` as an HF folder.
"""

from __future__ import annotations

from areal_like.algorithms.actors.preference import DPOActor
from areal_like.api import SaveLoadMeta
from areal_like.data.loader import ItemLoader, head_items
from areal_like.data.preference import build_pair_batch
from areal_like.data.prompt_limits import limit_prompt_length, load_tokenizer
from areal_like.data.sft import argmax_hits, build_sft_batch, greedy_exact_match
from areal_like.data.tasks import build_task
from areal_like.runtime.context import RunContext
from areal_like.runtime.dataset_steps import DatasetSteps
from areal_like.runtime.pair_runs import (
    load_train_valid_pairs,
    local_rows,
    pair_logprobs_once,
    with_reference,
)
from areal_like.runtime.recipe_args import parse_recipe_args
from areal_like.runtime.rl_setup import start_engine
from areal_like.utils.fast_exit import exit_now
from recipes.configs import DPOConfig


def main(argv: list[str] | None = None) -> None:
    config = parse_recipe_args(DPOConfig, "dpo_addition.yaml", argv)
    run = RunContext(config, console_keys=["dpo/train/loss", "eval/pair_accuracy",
                                              "eval/accuracy", "timeperf/startup"])
    tokenizer = load_tokenizer(config.model)
    train_pairs, valid_pairs = load_train_valid_pairs(config, tokenizer)
    engine = start_engine(config.actor, "actor")
    lora = config.actor.lora.enabled
    reference = engine.base_model_view() if lora else start_engine(config.ref, "ref")
    per_forward = config.ref_pairs_per_forward
    ref_train = pair_logprobs_once(run, reference, train_pairs, per_forward)
    ref_valid = pair_logprobs_once(run, reference, valid_pairs, per_forward)
    if not lora:
        reference.destroy()  # computed once: the reference's memory is free for training
    dpo = DPOActor(engine, config.loss)
    steps = DatasetSteps(config, run, engine)  # resumes after the last checkpoint
    order = ItemLoader(range(len(train_pairs)), config.pairs.batch_size, config.seed,
                       shuffle=config.pairs.shuffle).forever(skip=steps.start)
    valid_batch = local_rows(run, with_reference(build_pair_batch(valid_pairs), ref_valid,
                                                 list(range(len(valid_pairs)))))
    valid = config.valid_dataset
    items, _ = limit_prompt_length(build_task(valid, name="valid_dataset").dataset, tokenizer,
                                   valid, "valid_dataset")
    answers = local_rows(run, build_sft_batch(head_items(items, config.evaluation.n_prompts,
                                                         valid.shuffle, valid.seed), tokenizer))

    def evaluate() -> dict[str, float]:
        chosen, rejected = dpo.implicit_rewards(valid_batch)
        correct = greedy_exact_match(engine.forward(answers, post_hook=argmax_hits), answers)
        return {"eval/pair_accuracy": run.global_mean((chosen > rejected).float()),
                "eval/reward_margin": run.global_mean(chosen - rejected),
                "eval/accuracy": run.global_mean(correct.float())}

    if steps.start == 0:
        run.log_step(0, {"data/train_pairs": len(train_pairs), **evaluate()})
    for step in steps.range("dpo steps"):
        indices = next(order)
        batch = with_reference(build_pair_batch([train_pairs[i] for i in indices]), ref_train,
                               indices)
        stats = dpo.update(local_rows(run, batch))
        steps.end(step, stats, evaluate)  # LR, evaluation when due, metrics, checkpoint
    steps.finish()
    engine.save(SaveLoadMeta(str(run.dir / "final"), weight_format="hf", tokenizer=tokenizer))
    if run.is_main:
        print(f"final model: {run.dir / 'final'}", flush=True)
    run.close()


if __name__ == "__main__":
    main()
    exit_now()  # the run is over: skip the teardown of its imports (areal_like.utils.fast_exit)
