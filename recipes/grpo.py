"""Asynchronous GRPO-family RL on an SGLang fleet with an FSDP2 trainer.

GRPO, Dr.GRPO, DAPO, RLOO, REINFORCE++ and GSPO differ only in the `algorithm` section.

    python -m areal_like.launcher.local grpo [--config FILE] [key=value ...]   # starts the fleet
    torchrun --nproc_per_node=N -m recipes.grpo rollout.server_addrs=[host:port] ...
"""

from __future__ import annotations

from tensordict import TensorDict

from areal_like.algorithms import PPOActor, dynamic_sampling_filter
from areal_like.runtime.recipe_args import parse_recipe_args
from areal_like.runtime.rl_setup import RLSetup
from areal_like.utils.fast_exit import exit_now
from recipes.configs import GRPOConfig
from workflows import RLVRWorkflow


def main(argv: list[str] | None = None) -> None:
    config = parse_recipe_args(GRPOConfig, "grpo_addition.yaml", argv)
    rl = RLSetup(config)
    ref = rl.reference_engine() if config.use_ref_model else None
    actor = PPOActor(rl.actor_engine, config.algorithm, ref=ref)
    rl.track_state("actor", actor)  # the (adaptive) KL coefficient resumes with the run
    workflow = rl.make_workflow(RLVRWorkflow)  # or rollout.workflow's class

    def train_step(batch: TensorDict) -> dict[str, float]:
        if ref is not None:
            batch["ref_logp"] = actor.compute_ref_logp(batch)
        # proximal policy = current weights: recomputed, or the update's own forward's
        batch = actor.compute_advantages(batch)
        return actor.update(batch)

    # rollout runs <= eta versions ahead; DAPO's filter drops all-equal-reward groups
    rl.train(workflow, train_step, should_accept=dynamic_sampling_filter(config.algorithm))


if __name__ == "__main__":
    main()
    exit_now()  # the run is over: skip the teardown of its imports (areal_like.utils.fast_exit)
