"""A user's training script that raises where `FAIL_AT` (an environment variable, set through
`launcher.trainer_env.FAIL_AT`) says, for test_bad_runs.py: the
launcher must end the whole run within seconds with that exception last on screen.

FAIL_AT: actor (building the actor, after the fleet client and the rollout controller have
started; a bad config is refused before that, by the recipe's config check), batch (in the
rollout controller: the batch filter), step (the second train step), evaluation (a held-out
episode, in the rollout controller), checkpoint (saving tracked state)."""

from __future__ import annotations

import os
from typing import Any

from tensordict import TensorDict

from areal_like.algorithms import PPOActor
from areal_like.runtime.recipe_args import parse_recipe_args
from areal_like.runtime.rl_setup import RLSetup
from recipes.configs import GRPOConfig
from workflows import RLVRWorkflow

FAIL_AT = os.environ.get("FAIL_AT", "")


class InjectedError(RuntimeError):
    pass


def fail(where: str) -> None:
    raise InjectedError(f"injected fault: {where}")


def failing_filter(trajectory: Any) -> bool:
    fail("batch")
    return True


class FailingEvaluation(RLVRWorkflow):
    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> Any:
        fail("evaluation")


class FailingState:
    def state_dict(self) -> dict[str, Any]:
        fail("checkpoint")
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def main() -> None:
    config = parse_recipe_args(GRPOConfig, "")
    evaluation = None
    if FAIL_AT == "evaluation":
        def evaluation(rl: RLSetup) -> FailingEvaluation:
            return FailingEvaluation(rl.valid.reward_fn, config.gconfig.new(greedy=True,
                                                                             n_samples=1),
                                     rl.tokenizer)
    rl = RLSetup(config, eval_workflow=evaluation)
    if FAIL_AT == "actor":
        fail("actor")
    actor = PPOActor(rl.actor_engine, config.algorithm)
    if FAIL_AT == "checkpoint":
        rl.track_state("failing", FailingState())
    workflow = RLVRWorkflow(rl.task.reward_fn, config.gconfig, rl.tokenizer)
    steps = 0

    def train_step(batch: TensorDict) -> dict[str, float]:
        nonlocal steps
        steps += 1
        if FAIL_AT == "step" and steps == 2:
            fail("step")
        batch["prox_logp"] = actor.compute_logp(batch)
        return actor.update(actor.compute_advantages(batch))

    rl.train(workflow, train_step,
             should_accept=failing_filter if FAIL_AT == "batch" else None)


if __name__ == "__main__":
    main()
