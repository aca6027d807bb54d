"""Held-out evaluation through the live inference fleet: greedy accuracy and pass@k."""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from transformers import PreTrainedTokenizerBase

from areal_like.api import GenerationHyperparameters, InferenceEngine, RolloutWorkflow
from areal_like.rewards.executor import RewardExecutor
from workflows.rlvr import RLVRWorkflow


def evaluate(rollout: InferenceEngine, items: list[dict[str, Any]],
             reward_fn: Callable[..., Any], tokenizer: PreTrainedTokenizerBase,
             gconfig: GenerationHyperparameters, pass_k: int = 1, temperature: float = 1.0,
             timeout: float = 600.0, reward_executor: RewardExecutor | None = None,
             workflow: RolloutWorkflow | None = None) -> dict[str, float]:
    """`eval/accuracy`: fraction of items whose greedy answer earns reward > 0.5, and
    `eval/reward`: their mean reward; `eval/pass@k` (when `pass_k > 1`): fraction with at
    least one of k samples right. `workflow` replaces the greedy RLVR workflow (e.g. a
    multi-turn or agent workflow built with a greedy gconfig).

    Episodes run on the rollout engine's loop next to training rollouts, but outside the
    executor, so they neither count against the staleness budget nor enter training batches.
    """
    executor = getattr(rollout, "executor", None)
    if executor is None:
        raise RuntimeError("evaluate() needs an initialized rollout engine with an executor")
    reward_executor = reward_executor or RewardExecutor()
    greedy = workflow or RLVRWorkflow(reward_fn, gconfig.new(greedy=True, n_samples=1),
                                      tokenizer, reward_executor)

    async def run(wf: RolloutWorkflow) -> list[Any]:
        return await asyncio.gather(*[wf.arun_episode(rollout, it) for it in items])

    results = executor.run_coroutine(run(greedy), timeout=timeout)
    rewards = [float(td["rewards"].max()) for td in results]
    out = {"eval/accuracy": sum(r > 0.5 for r in rewards) / len(rewards),
           "eval/reward": sum(rewards) / len(rewards), "eval/n": float(len(rewards))}
    if pass_k > 1:
        sampled = RLVRWorkflow(reward_fn, gconfig.new(n_samples=pass_k, greedy=False,
                                                      temperature=temperature),
                               tokenizer, reward_executor)
        groups = executor.run_coroutine(run(sampled), timeout=timeout)
        out[f"eval/pass@{pass_k}"] = sum(float(td["rewards"].max()) > 0.5
                                         for td in groups) / len(groups)
    return out
