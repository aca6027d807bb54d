"""PPO with a critic on process rewards: a PRM scores every reasoning step of a completion,
the score sits on the step's last token, GAE(gamma, lambda) runs over those dense rewards.

    python -m areal_like.launcher.local ppo_prm [key=value ...]
    python -m recipes.ppo_prm prm.url=http://127.0.0.1:8391 ...   # a PRM already served
"""

from __future__ import annotations

import contextlib

from tensordict import TensorDict

from areal_like.algorithms import CriticActor, PPOActor
from areal_like.rewards.prm_client import PRMClient
from areal_like.rewards.prm_server import PRMService
from areal_like.runtime.recipe_args import parse_recipe_args
from areal_like.runtime.rl_setup import RLSetup, start_engine
from areal_like.utils.fast_exit import exit_now
from recipes.configs import PPOPRMConfig
from workflows.prm import PRMWorkflow


def main(argv: list[str] | None = None) -> None:
    config = parse_recipe_args(PPOPRMConfig, "ppo_prm_addition.yaml", argv)
    with contextlib.ExitStack() as stack:
        rl = RLSetup(config)
        actor = PPOActor(rl.actor_engine, config.algorithm)
        critic = CriticActor(start_engine(config.critic), config.algorithm)
        url = config.prm.url
        if not url and rl.run.is_main:  # rank 0 rolls out: it serves the PRM beside the run
            url = stack.enter_context(PRMService(
                config.prm.model_path, port=config.prm.port,
                startup_timeout=config.prm.startup_timeout, log_path=rl.run.dir / "prm.log")).url
        prm = PRMClient(url, config.prm.timeout) if rl.run.is_main else None
        # rollout.workflow may name a subclass (workflows.vision_prm:VisionPRMWorkflow)
        workflow = rl.workflow_class(PRMWorkflow)(
            rl.task.reward_fn, config.gconfig, rl.tokenizer, prm, config.prm.step_delimiter,
            config.prm.empty_reward, config.prm.average_steps, config.prm.outcome_coef,
            config.prm.score_offset)

        def train_step(batch: TensorDict) -> dict[str, float]:
            batch["values"] = critic.compute_values(batch)  # V(s_t)
            batch = actor.compute_advantages(batch)  # GAE over step rewards, then normalised
            stats = actor.update(batch)  # ppo_epochs x ppo_n_minibatches optimizer steps
            return stats | {f"critic/{k}": v for k, v in critic.update(batch).items()}

        rl.train(workflow, train_step, extra_engines=(critic.engine,))


if __name__ == "__main__":
    main()
    exit_now()  # the run is over: skip the teardown of its imports (areal_like.utils.fast_exit)
