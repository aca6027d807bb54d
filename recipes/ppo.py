"""PPO with a learned critic: values from a value model, advantages by GAE.

    python -m areal_like.launcher.local ppo [key=value ...]
"""

from __future__ import annotations

from tensordict import TensorDict

from areal_like.algorithms import CriticActor, PPOActor
from areal_like.runtime.recipe_args import parse_recipe_args
from areal_like.runtime.rl_setup import RLSetup, start_engine
from areal_like.utils.fast_exit import exit_now
from recipes.configs import PPOConfig
from workflows import RLVRWorkflow


def main(argv: list[str] | None = None) -> None:
    config = parse_recipe_args(PPOConfig, "ppo_addition.yaml", argv)
    rl = RLSetup(config)
    actor = PPOActor(rl.actor_engine, config.algorithm)
    rl.track_state("actor", actor)  # KL coefficient, running statistics
    critic = CriticActor(start_engine(config.critic), config.algorithm)
    workflow = rl.make_workflow(RLVRWorkflow)  # or rollout.workflow's class

    def train_step(batch: TensorDict) -> dict[str, float]:
        batch["values"] = critic.compute_values(batch)  # V(s_t)
        batch = actor.compute_advantages(batch)  # GAE(gamma, lambda) and returns
        stats = actor.update(batch)
        return stats | {f"critic/{k}": v for k, v in critic.update(batch).items()}

    rl.train(workflow, train_step, extra_engines=(critic.engine,))


if __name__ == "__main__":
    main()
    exit_now()  # the run is over: skip the teardown of its imports (areal_like.utils.fast_exit)
