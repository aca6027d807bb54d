"""Reward-model training on preference pairs: the LM with a scalar head, Bradley-Terry loss.

    python -m recipes.rm [--config FILE] [key=value ...]      (or: areal-like run rm)

Each step trains on `pairs.batch_size` pairs: -log sigmoid(r(chosen) - r(rejected) - margin),
r the head's output at a sequence's last token. Every `evaluation.freq_steps` the held-out
pairs' accuracy (r(chosen) > r(rejected)) and mean margin are logged. The final reward model
is written to `<run dir>/final` as a Hugging Face sequence-classification folder, which
`python -m areal_like.rewards.rm_server --model DIR` serves to RL and `areal-like eval DIR`
scores by pair accuracy.
"""

from __future__ import annotations

from areal_like.algorithms.actors.preference import RewardModelActor
from areal_like.api import SaveLoadMeta
from areal_like.data.loader import ItemLoader
from areal_like.data.preference import build_pair_batch
from areal_like.data.prompt_limits import load_tokenizer
from areal_like.rewards.rm_model import export_reward_model
from areal_like.runtime.context import RunContext
from areal_like.runtime.dataset_steps import DatasetSteps
from areal_like.runtime.pair_runs import load_train_valid_pairs, local_rows
from areal_like.runtime.recipe_args import parse_recipe_args
from areal_like.utils.fast_exit import exit_now
from engines import FSDPEngine
from recipes.configs import RMConfig


def main(argv: list[str] | None = None) -> None:
    config = parse_recipe_args(RMConfig, "rm_addition.yaml", argv)
    run = RunContext(config, console_keys=["rm/train/accuracy/avg", "eval/pair_accuracy",
                                              "eval/reward_margin", "timeperf/startup"])
    tokenizer = load_tokenizer(config.model)
    train_pairs, valid_pairs = load_train_valid_pairs(config, tokenizer)
    engine = FSDPEngine(config.actor)
    engine.initialize()
    rm = RewardModelActor(engine, config.loss)
    steps = DatasetSteps(config, run, engine)  # resumes after the last checkpoint
    loader = ItemLoader(train_pairs, config.pairs.batch_size, config.seed,
                        shuffle=config.pairs.shuffle)
    batches = loader.forever(skip=steps.start)  # the batches not yet trained on
    valid_batch = local_rows(run, build_pair_batch(valid_pairs))

    def evaluate() -> dict[str, float]:
        chosen, rejected = rm.pair_scores(valid_batch)
        return {"eval/pair_accuracy": run.global_mean((chosen > rejected).float()),
                "eval/reward_margin": run.global_mean(chosen - rejected)}

    if steps.start == 0:
        run.log_step(0, {"data/train_pairs": len(train_pairs), **evaluate()})
    for step in steps.range("rm steps"):
        stats = rm.update(local_rows(run, build_pair_batch(next(batches))))
        steps.end(step, stats, evaluate)  # LR, evaluation when due, metrics, checkpoint
    steps.finish()
    final = run.dir / "final"
    engine.save(SaveLoadMeta(str(final), weight_format="hf", tokenizer=tokenizer))
    if run.is_main:
        export_reward_model(final)  # the folder as a sequence-classification reward model
        print(f"final model: {final}", flush=True)
    run.close()


if __name__ == "__main__":
    main()
    exit_now()  # the run is over: skip the teardown of its imports (areal_like.utils.fast_exit)
