"""Shared prefixes (`actor.shared_prefix`) on real trajectories: a rollout batch's log-probs,
entropy, a GRPO loss and every gradient through the prefix tree against the same batch
packed whole, in float64. The workflow tests call it on what real servers gave them (tool
agent, memory agent, agent programs through the gateway); tests/test_shared_prefix.py holds
the synthetic cases and the engine's float32 path."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import torch
from tensordict import TensorDict

from areal_like.utils.packed_logprobs import next_token_logprobs_entropy, shift_packed_to_next_token
from engines.fsdp.attention import PACKED_SDPA, packed_model_kwargs
from engines.fsdp.shared_prefix import build_prefix_tree

# float64 throughout: a shared row's gradient summed once or per copy differs in rounding only
LOGP_ATOL = 1e-10
GRAD_ATOL, GRAD_RTOL = 1e-10, 1e-9


def rms_norm_in_input_dtype(self: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Qwen2's RMSNorm, without its cast to float32 (which would make a float64 model's
    backward float32-accurate only: summing a shared row's gradient once or per copy then
    differs by ~1e-7 relative)."""
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))


def _unpadded(batch: TensorDict) -> TensorDict:
    """The rows of a rollout batch packed as the engine packs them (padding dropped)."""
    keep = batch["attention_mask"].bool()
    lengths = keep.sum(1)
    return TensorDict({
        "input_ids": batch["input_ids"][keep],
        "loss_mask": batch["loss_mask"][keep],
        "cu_seqlens": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
        "advantages": torch.repeat_interleave(_group_advantages(batch), lengths),
    }, batch_size=[])


def _group_advantages(batch: TensorDict) -> torch.Tensor:
    """GRPO's: each row's reward less its group's mean (over the std where it is > 0); rows
    with equal rewards get a fixed ramp instead, so that the loss always has a gradient."""
    rewards = batch["rewards"].double().reshape(-1)
    groups = batch["group_id"].reshape(-1) if "group_id" in batch.keys() else torch.zeros_like(
        rewards, dtype=torch.long)
    adv = torch.zeros_like(rewards)
    for g in groups.unique():
        rows = groups == g
        r = rewards[rows]
        adv[rows] = (r - r.mean()) / (r.std() if r.numel() > 1 and r.std() > 0 else 1.0)
    if not adv.abs().sum():
        adv = torch.linspace(-1.0, 1.0, len(adv), dtype=torch.float64)
    return adv


def _loss(logits: torch.Tensor, mb: TensorDict) -> tuple[torch.Tensor, torch.Tensor,
                                                         torch.Tensor]:
    """(log-probs, entropy, loss): a GRPO token-mean loss less an entropy bonus."""
    logp, entropy = next_token_logprobs_entropy(logits, mb)
    mask = shift_packed_to_next_token(mb["loss_mask"], mb["cu_seqlens"]).double()
    adv = shift_packed_to_next_token(mb["advantages"], mb["cu_seqlens"])
    loss = -((adv * logp - 1e-3 * entropy) * mask).sum() / mask.sum().clamp(min=1)
    return logp, entropy, loss


def assert_tree_parity(model_dir: Path, batch: TensorDict) -> tuple[int, int]:
    """Asserts that the prefix tree gives `batch` the log-probs, entropy, loss and gradients of
    the packed whole (float64, `LOGP_ATOL`, `GRAD_ATOL`/`GRAD_RTOL`) and that it shares
    something; returns (tokens, tree rows)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen2 import modeling_qwen2

    mb = _unpadded(batch)
    ids, cu = mb["input_ids"], mb["cu_seqlens"]
    tree = build_prefix_tree(ids, cu, break_even=1.0)  # the tree whatever it saves
    assert tree is not None and tree.n_rows < ids.numel(), "nothing shared in this batch"
    assert torch.equal(tree.input_ids[tree.unshared], ids)
    depth = torch.cat([torch.arange(int(n)) for n in cu.diff()])
    with mock.patch.object(modeling_qwen2.Qwen2RMSNorm, "forward", rms_norm_in_input_dtype):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64,
                                                     attn_implementation=PACKED_SDPA)
        runs = []
        for shared in (True, False):
            model.zero_grad()
            if shared:
                logits = model(input_ids=tree.input_ids[None],
                               position_ids=tree.position_ids[None], attention_mask=None,
                               use_cache=False, tree_buckets=tree.attention).logits[0]
                logits = logits.index_select(0, tree.unshared)
            else:
                logits = model(input_ids=ids[None], position_ids=depth[None],
                               attention_mask=None, use_cache=False,
                               **packed_model_kwargs(cu)).logits[0]
            logp, entropy, loss = _loss(logits, mb)
            loss.backward()
            runs.append((logp.detach(), entropy.detach(), loss.detach(),
                         {n: p.grad.clone() for n, p in model.named_parameters()}))
    (logp_t, ent_t, loss_t, grads_t), (logp, ent, loss, grads) = runs
    torch.testing.assert_close(logp_t, logp, atol=LOGP_ATOL, rtol=0)
    torch.testing.assert_close(ent_t, ent, atol=LOGP_ATOL, rtol=0)
    torch.testing.assert_close(loss_t, loss, atol=LOGP_ATOL, rtol=0)
    assert any(g.abs().sum() > 0 for g in grads.values())
    for name, grad in grads.items():
        torch.testing.assert_close(grads_t[name], grad, atol=GRAD_ATOL, rtol=GRAD_RTOL,
                                   msg=lambda m, name=name: f"{name}: {m}")
    return int(ids.numel()), tree.n_rows
