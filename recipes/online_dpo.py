"""Online DPO: pairs sampled from the current policy through the fleet, ranked by the reward.

    python -m areal_like.launcher.local online_dpo [--config FILE] [key=value ...]

The GRPO loop unchanged (asynchronous rollouts within the staleness bound, held-out
evaluation, checkpoints, weight sync); only the training step differs: in each group of
`algorithm.group_size` samples of one prompt, the best-rewarded sample is chosen and the
worst rejected (a group whose rewards are all equal gives no pair), the reference's
log-probs of the pairs are computed, and DPO (`loss`) takes one optimizer step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from tensordict import TensorDict

from areal_like.algorithms.actors.preference import DPOActor
from areal_like.algorithms.functional import group_index_from_ids
from areal_like.runtime.recipe_args import parse_recipe_args
from areal_like.runtime.rl_setup import RLSetup
from areal_like.utils.fast_exit import exit_now
from recipes.configs import OnlineDPOConfig
from workflows import RLVRWorkflow


def best_and_worst(batch: TensorDict, group_size: int) -> TensorDict:
    """A pair batch (chosen, rejected per group with distinct rewards) from rollout rows."""
    rewards = batch["rewards"].float()
    if rewards.dim() == 2:  # dense rewards: the sequence's total
        rewards = rewards.sum(-1)
    groups = group_index_from_ids(batch.get("group_id", None), batch.shape[0], group_size)
    rows: list[int] = []
    for g in range(int(groups.max()) + 1 if groups.numel() else 0):
        members = (groups == g).nonzero().reshape(-1)
        best, worst = members[rewards[members].argmax()], members[rewards[members].argmin()]
        if rewards[best] > rewards[worst]:
            rows += [int(best), int(worst)]
    index = torch.tensor(rows, dtype=torch.long)
    n_pairs = len(rows) // 2
    return TensorDict({
        **{k: batch[k][index] for k in ("input_ids", "attention_mask", "loss_mask")},
        "loss_group_id": torch.arange(n_pairs).repeat_interleave(2),
        "is_chosen": torch.tensor([True, False] * n_pairs, dtype=torch.bool),
        "margin": torch.zeros(2 * n_pairs),
    }, batch_size=[2 * n_pairs])


def main(argv: list[str] | None = None) -> None:
    config = parse_recipe_args(OnlineDPOConfig, "online_dpo_addition.yaml", argv)
    rl = RLSetup(config)
    reference = rl.reference_engine()  # with actor.lora: the actor's base, adapters off
    dpo = DPOActor(rl.actor_engine, config.loss)

    def train_step(batch: TensorDict) -> dict[str, float]:
        pairs = best_and_worst(batch, config.algorithm.group_size)
        n_pairs = torch.tensor([pairs.shape[0] // 2], dtype=torch.long)
        if dist.is_initialized():
            dist.all_reduce(n_pairs)
        if int(n_pairs) == 0:  # every group tied on every rank: nothing to prefer
            return {"online_dpo/pairs": 0.0}
        pairs["ref_logp"] = DPOActor.response_logprobs(reference, pairs)
        return dpo.update(pairs) | {"online_dpo/pairs": float(n_pairs)}

    rl.train(rl.make_workflow(RLVRWorkflow), train_step)


if __name__ == "__main__":
    main()
    exit_now()  # the run is over: skip the teardown of its imports (areal_like.utils.fast_exit)
