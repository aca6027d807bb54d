"""Held-out evaluation through the live inference fleet: greedy accuracy and pass@k."""

from __future__ import annotations

import asyncio
import math
from typing import Any, Callable

from transformers import PreTrainedTokenizerBase

from areal_like.api import GenerationHyperparameters, InferenceEngine, RolloutWorkflow
from areal_like.api.seeding import begin_episode
from areal_like.rewards.failures import failures_of
from areal_like.rewards.reward_executor import RewardExecutor
from areal_like.utils import stats_tracker
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


# An answer is correct when the task's checker gives it full credit: every built-in verifier
# scores a right answer 1.0, and partial credit (reasoning-gym gives 0.5 for "5" to "-5") is
# not correctness — it shows in `eval/reward`.
FULL_CREDIT = 1.0


def episode_accuracy(trajectory: Any) -> float:
    """How right one evaluated episode is: its `accuracy` key when the workflow records one
    (e.g. the memory agent's QA accuracy), else whether its best reward is full credit."""
    if "accuracy" in trajectory.keys():
        return float(trajectory["accuracy"].reshape(-1)[0])
    return float(float(trajectory["rewards"].max()) >= FULL_CREDIT)


def episode_metrics(trajectories: list[Any], keys: tuple[str, ...]) -> dict[str, float]:
    """Mean over episodes of per-sequence `keys` (first row of each episode: every row of an
    episode carries the episode's value)."""
    out = {}
    for key in keys:
        values = [float(td[key].reshape(-1)[0]) for td in trajectories if key in td.keys()]
        if values:
            out[key] = sum(values) / len(values)
    return out


def record_episode_metrics(batch: Any, keys: tuple[str, ...], scope: str = "episode") -> None:
    """Log the mean over the batch's episodes (one per `group_id`) of per-sequence `keys`."""
    present = [k for k in keys if k in batch.keys()]
    if not present:
        return
    group_ids = batch["group_id"].tolist() if "group_id" in batch.keys() else range(len(batch))
    first = sorted({g: i for i, g in reversed(list(enumerate(group_ids)))}.values())
    with stats_tracker.scope(scope):
        stats_tracker.scalar(**episode_metrics([batch[i:i + 1] for i in first], tuple(present)))


async def _episode(rollout: InferenceEngine, wf: RolloutWorkflow, item: dict[str, Any],
                   seed: int) -> Any:
    """One evaluation episode; a failed reward is returned (counted, excluded), not raised."""
    begin_episode(seed)  # gather runs each episode in its own task (its own context)
    try:
        return await wf.arun_episode(rollout, item)
    except Exception as e:
        if failures_of(e) is None:
            raise
        return e


class Evaluator:
    """Held-out evaluation of one policy version (see `evaluate` for the metrics).

    `draw_seeds` takes the episodes' seeds from the executor (in a fixed order, so a run
    repeats exactly); `arun` then runs the episodes on the rollout loop, where it can run
    beside training rollouts (`RolloutController.run_at_version`). Episodes run `workflow`,
    else `rlvr_class` (an `RLVRWorkflow` or a subclass, e.g. the one for images) with a
    greedy and a sampling `gconfig`."""

    def __init__(self, items: list[dict[str, Any]], reward_fn: Callable[..., Any],
                 tokenizer: PreTrainedTokenizerBase, gconfig: GenerationHyperparameters,
                 pass_k: int = 1, temperature: float = 1.0,
                 reward_executor: RewardExecutor | None = None,
                 workflow: RolloutWorkflow | None = None, pass_n: int = 0,
                 rlvr_class: type[RLVRWorkflow] = RLVRWorkflow) -> None:
        self.items = items
        self.greedy = workflow or rlvr_class(reward_fn, gconfig.new(greedy=True, n_samples=1),
                                             tokenizer, reward_executor)
        self.pass_k, self.pass_n = pass_k, pass_n or pass_k
        self.sampled = None
        if pass_k > 1:
            self.sampled = rlvr_class(reward_fn, gconfig.new(n_samples=self.pass_n,
                                                             greedy=False,
                                                             temperature=temperature),
                                      tokenizer, reward_executor)

    def draw_seeds(self, rollout: Any) -> list[list[int]]:
        """One seed per item and workflow (greedy, then sampled), from `rollout.episode_seed`."""
        runs = [self.greedy] + ([self.sampled] if self.sampled is not None else [])
        return [[rollout.episode_seed(item) for item in self.items] for _ in runs]

    async def _episodes(self, engine: InferenceEngine, wf: RolloutWorkflow,
                        seeds: list[int]) -> tuple[list[Any], int]:
        pairs = zip(self.items, seeds, strict=True)
        results = await asyncio.gather(*[_episode(engine, wf, it, seed) for it, seed in pairs])
        done = [r for r in results if not isinstance(r, BaseException)]
        return done, len(results) - len(done)

    async def arun(self, engine: InferenceEngine, seeds: list[list[int]]) -> dict[str, float]:
        results, failed = await self._episodes(engine, self.greedy, seeds[0])
        out = {"eval/n": float(len(results)), "eval/reward_failed": float(failed)}
        if not results:
            return out
        rewards = [float(td["rewards"].max()) for td in results]
        out["eval/accuracy"] = sum(map(episode_accuracy, results)) / len(results)
        out["eval/reward"] = sum(rewards) / len(rewards)
        keys = tuple(getattr(self.greedy, "metric_keys", ()))
        out |= {f"eval/{k}": v for k, v in episode_metrics(results, keys).items()}
        if self.sampled is not None:
            groups, failed = await self._episodes(engine, self.sampled, seeds[1])
            out["eval/reward_failed"] += failed
            if groups:
                n, k = self.pass_n, self.pass_k
                correct = [int((td["rewards"] >= FULL_CREDIT).sum()) for td in groups]
                out[f"eval/pass@{k}"] = sum(pass_at_k(n, c, k) for c in correct) / len(correct)
                out["eval/pass@1"] = sum(correct) / (n * len(correct))
        return out


def evaluate(rollout: Any, items: list[dict[str, Any]],
             reward_fn: Callable[..., Any], tokenizer: PreTrainedTokenizerBase,
             gconfig: GenerationHyperparameters, pass_k: int = 1, temperature: float = 1.0,
             timeout: float = 600.0, reward_executor: RewardExecutor | None = None,
             workflow: RolloutWorkflow | None = None, pass_n: int = 0) -> dict[str, float]:
    """`eval/accuracy`: mean greedy-episode accuracy (`episode_accuracy`), and `eval/reward`:
    mean reward. With `pass_k > 1`, `pass_n` (default `pass_k`) answers per item are sampled
    at `temperature`: `eval/pass@k` is the mean unbiased estimate of the chance that one of k
    samples is right, `eval/pass@1` the fraction of right samples. `workflow` replaces the
    greedy RLVR workflow (e.g. a multi-turn or agent workflow built with a greedy gconfig);
    its `metric_keys` are reported as `eval/<key>`. Samples are seeded by the executor, so a
    run repeats exactly. Items whose reward failed are excluded and counted
    (`eval/reward_failed`): a failed reward is not a wrong answer.

    `rollout` is a `RolloutController`: episodes run on its loop next to training rollouts,
    but outside its executor, so they neither count against the staleness budget nor enter
    training batches. This call blocks until they are done (see `Evaluator` to run them in
    the background).
    """
    evaluator = Evaluator(items, reward_fn, tokenizer, gconfig, pass_k, temperature,
                          reward_executor, workflow, pass_n)
    seeds = evaluator.draw_seeds(rollout)
    return rollout.run_coroutine(evaluator.arun(rollout.engine, seeds), timeout=timeout)
