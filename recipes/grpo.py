"""Asynchronous GRPO-family RL on an SGLang fleet with an FSDP2 trainer.

GRPO, Dr.GRPO, DAPO, RLOO, REINFORCE++ and GSPO differ only in the `algorithm` section.

    python -m areal_like.launcher.local grpo [--config FILE] [key=value ...]   # starts the fleet
    torchrun --nproc_per_node=N -m recipes.grpo rollout.server_addrs=[host:port] ...
"""

from __future__ import annotations

from transformers import AutoTokenizer

from areal_like.algorithms import PPOActor, dynamic_sampling_filter
from areal_like.data.loader import ItemLoader
from areal_like.data.tasks import build_task
from areal_like.runtime.checkpoint import Checkpointer
from areal_like.runtime.cli import parse_recipe_args
from areal_like.runtime.context import RunContext
from areal_like.runtime.evaluation import evaluate
from areal_like.runtime.recover import maybe_recover, save_checkpoint
from areal_like.runtime.weight_sync import push_weights
from areal_like.utils.plotting import plot_run
from engines import FSDPEngine, RemoteSGLangEngine
from recipes.configs import GRPOConfig
from workflows import RLVRWorkflow

CONSOLE = ["actor/task_reward/avg", "eval/accuracy", "rollout/staleness_max", "timeperf/step"]


def main(argv: list[str] | None = None) -> None:
    config = parse_recipe_args(GRPOConfig, "grpo_addition.yaml", argv)
    run = RunContext(config, console_keys=CONSOLE)
    tokenizer = AutoTokenizer.from_pretrained(config.model.path)
    task, valid = build_task(config.train_dataset), build_task(config.valid_dataset)

    actor_engine = FSDPEngine(config.actor)
    actor_engine.initialize()
    ref = None
    if config.use_ref_model:
        ref = FSDPEngine(config.ref)
        ref.initialize()
    actor = PPOActor(actor_engine, config.algorithm, ref=ref)

    rollout = None  # rank 0 drives rollout; every rank trains
    if run.is_main:
        rollout = RemoteSGLangEngine(config.rollout)
        rollout.initialize()
    workflow = RLVRWorkflow(task.reward_fn, config.gconfig, tokenizer)
    loader = ItemLoader(task.dataset, config.train_dataset.batch_size, config.seed)
    accept = dynamic_sampling_filter(config.algorithm)
    ckpt = Checkpointer(config.checkpoint, run.dir, run.rank)
    eval_items = valid.dataset.to_list()[: config.evaluation.n_prompts]

    def held_out() -> dict[str, float]:
        if rollout is None:
            return {}
        return evaluate(rollout, eval_items, valid.reward_fn, tokenizer, config.gconfig,
                        config.evaluation.pass_k, config.evaluation.temperature)

    start = maybe_recover(ckpt, run, actor_engine, rollout)
    if start == 0:
        run.log_step(0, held_out())
    for step in range(start, config.total_train_steps):
        with run.timing("rollout"):  # waits only if rollout has fallen behind (bounded by eta)
            batch = rollout.prepare_batch(loader, workflow, accept) if rollout else None
            batch = run.broadcast_batch(batch, config.algorithm.group_size)
        with run.timing("train"):
            batch["prox_logp"] = actor.compute_logp(batch)  # proximal policy = current weights
            batch = actor.compute_advantages(batch)
            stats = actor.update(batch)
            actor_engine.step_lr_scheduler()
        with run.timing("weight_sync"):  # pause fleet -> load v+1 -> continue; version bump
            stats |= push_weights(actor_engine, rollout, step + 1, run.weights_dir)
        last = step + 1 == config.total_train_steps
        freq = config.evaluation.freq_steps
        if freq and ((step + 1) % freq == 0 or last):
            stats |= held_out()
        if ckpt.should_save(step, last):
            save_checkpoint(ckpt, step, actor_engine, rollout)
        run.log_step(step + 1, stats)

    run.summarize("eval/accuracy")
    if run.is_main and config.logging.plot:
        png = plot_run(run.metrics.jsonl_path, run.dir / "curves.png", run.dir.name)
        print(f"curves: {png}", flush=True)
    if rollout is not None:
        rollout.destroy()
    run.close()


if __name__ == "__main__":
    main()
