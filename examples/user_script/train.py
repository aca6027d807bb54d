"""A training script of your own, started by a launcher like a recipe:

    python -m areal_like.launcher.local examples/user_script/train.py \
        --config examples/user_script/config.yaml model.path=<model folder>
    python -m areal_like.launcher.ray examples/user_script/train.py \
        --config examples/user_script/config.yaml model.path=<model folder>

The launcher starts the SGLang fleet and runs this file on every trainer rank (under torchrun, or
as Ray actors) with `--config FILE key=value ...` and `rollout.server_addrs=[...]` added. Here:
GRPO whose step also logs a statistic of its own (`user/*` lands in metrics.jsonl).
"""

from __future__ import annotations

from tensordict import TensorDict

from areal_like.algorithms import PPOActor
from areal_like.algorithms.filters import sequence_rewards
from areal_like.runtime.recipe_args import parse_recipe_args
from areal_like.runtime.rl_setup import RLSetup
from recipes.configs import GRPOConfig
from workflows import RLVRWorkflow


def main() -> None:
    config = parse_recipe_args(GRPOConfig, "")  # --config is required for a script
    rl = RLSetup(config)
    actor = PPOActor(rl.actor_engine, config.algorithm)
    workflow = RLVRWorkflow(rl.task.reward_fn, config.gconfig, rl.tokenizer)

    def train_step(batch: TensorDict) -> dict[str, float]:
        solved = (sequence_rewards(batch["rewards"]) > 0.5).float().mean().item()
        batch = actor.compute_advantages(batch)  # (the proximal log-probs too, when needed)
        stats = actor.update(batch)
        return {**stats, "user/solved_fraction": solved, "user/world_size": rl.run.world_size}

    rl.train(workflow, train_step)


if __name__ == "__main__":
    main()
