"""Held-out evaluation through the live inference fleet: greedy accuracy and pass@k."""

from __future__ import annotations

import asyncio
import math
from typing import Any, Callable

from transformers import PreTrainedTokenizerBase

from areal_like.api import GenerationHyperparameters, InferenceEngine, RolloutWorkflow
from areal_like.api.seeding import begin_episode
from areal_like.rewards.executor import RewardExecutor
from workflows.rlvr import RLVRWorkflow


def pass_at_k(n: int, correct: int, k: int) -> float:
    """The unbiased estimate of pass@k from `n` samples of which `correct` are right: the
    chance that k of them, drawn without replacement, include a right one (Chen et al. 2021)."""
    if not 0 <= correct <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= correct <= n and 1 <= k <= n; got n={n}, "
                         f"correct={correct}, k={k}")
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def evaluate(rollout: InferenceEngine, items: list[dict[str, Any]],
             reward_fn: Callable[..., Any], tokenizer: PreTrainedTokenizerBase,
             gconfig: GenerationHyperparameters, pass_k: int = 1, temperature: float = 1.0,
             timeout: float = 600.0, reward_executor: RewardExecutor | None = None,
             workflow: RolloutWorkflow | None = None, pass_n: int = 0) -> dict[str, float]:
    """`eval/accuracy`: fraction of items whose greedy answer earns reward > 0.5, and
    `eval/reward`: their mean reward. With `pass_k > 1`, `pass_n` (default `pass_k`) answers
    per item are sampled at `temperature`: `eval/pass@k` is the mean unbiased estimate of the
    chance that one of k samples is right, `eval/pass@1` the fraction of right samples.
    `workflow` replaces the greedy RLVR workflow (e.g. a multi-turn or agent workflow built
    with a greedy gconfig). Samples are seeded by the executor, so a run repeats exactly.

    Episodes run on the rollout engine's loop next to training rollouts, but outside the
    executor, so they neither count against the staleness budget nor enter training batches.
    """
    executor = getattr(rollout, "executor", None)
    if executor is None:
        raise RuntimeError("evaluate() needs an initialized rollout engine with an executor")
    reward_executor = reward_executor or RewardExecutor()
    greedy = workflow or RLVRWorkflow(reward_fn, gconfig.new(greedy=True, n_samples=1),
                                      tokenizer, reward_executor)

    async def episode(wf: RolloutWorkflow, item: dict[str, Any], seed: int) -> Any:
        begin_episode(seed)  # gather runs each episode in its own task (its own context)
        return await wf.arun_episode(rollout, item)

    async def episodes(wf: RolloutWorkflow, seeds: list[int]) -> list[Any]:
        pairs = zip(items, seeds, strict=True)
        return await asyncio.gather(*[episode(wf, it, seed) for it, seed in pairs])

    def run(wf: RolloutWorkflow) -> list[Any]:
        seeds = [executor.episode_seed(it) for it in items]  # reproducible samples
        return executor.run_coroutine(episodes(wf, seeds), timeout=timeout)

    results = run(greedy)
    rewards = [float(td["rewards"].max()) for td in results]
    out = {"eval/accuracy": sum(r > 0.5 for r in rewards) / len(rewards),
           "eval/reward": sum(rewards) / len(rewards), "eval/n": float(len(rewards))}
    if pass_k > 1:
        n = pass_n or pass_k
        sampled = RLVRWorkflow(reward_fn, gconfig.new(n_samples=n, greedy=False,
                                                      temperature=temperature),
                               tokenizer, reward_executor)
        correct = [int((td["rewards"] > 0.5).sum()) for td in run(sampled)]
        out[f"eval/pass@{pass_k}"] = sum(pass_at_k(n, c, pass_k) for c in correct) / len(correct)
        out["eval/pass@1"] = sum(correct) / (n * len(correct))
    return out
