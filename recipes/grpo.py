"""Asynchronous GRPO-family RL on an SGLang fleet with an FSDP2 trainer.

GRPO, Dr.GRPO, DAPO, RLOO, REINFORCE++ and GSPO differ only in the `algorithm` section.

    python -m areal_like.launcher.local grpo [--config FILE] [key=value ...]   # starts the fleet
    torchrun --nproc_per_node=N -m recipes.grpo rollout.server_addrs=[host:port] ...
"""

from __future__ import annotations

from areal_like.algorithms import PPOActor, dynamic_sampling_filter
from areal_like.runtime.cli import parse_recipe_args
from areal_like.runtime.rl_setup import RLSetup, start_engine
from recipes.configs import GRPOConfig
from workflows import RLVRWorkflow


def main(argv: list[str] | None = None) -> None:
    config = parse_recipe_args(GRPOConfig, "grpo_addition.yaml", argv)
    rl = RLSetup(config)
    ref = start_engine(config.ref) if config.use_ref_model else None
    actor = PPOActor(rl.actor_engine, config.algorithm, ref=ref)
    workflow = RLVRWorkflow(rl.task.reward_fn, config.gconfig, rl.tokenizer)
    accept = dynamic_sampling_filter(config.algorithm)  # DAPO: drop all-equal-reward groups

    for step in rl.steps():
        with rl.timing("rollout"):  # waits only if rollout fell behind (it runs <= eta ahead)
            batch = rl.next_batch(workflow, accept)
        with rl.timing("train"):
            if ref is not None:
                batch["ref_logp"] = actor.compute_ref_logp(batch)
            batch["prox_logp"] = actor.compute_logp(batch)  # proximal policy = current weights
            batch = actor.compute_advantages(batch)
            stats = actor.update(batch)
        with rl.timing("weight_sync"):  # pause fleet -> load version step+1 -> resume
            stats |= rl.push_weights(step)
        rl.end_step(step, stats)  # lr schedule, evaluation, checkpoint, metrics
    rl.finish()


if __name__ == "__main__":
    main()
