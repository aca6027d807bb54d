"""Shared prefixes computed once (engines/fsdp/shared_prefix.py, `actor.shared_prefix`).

The tree's forward and backward against the same model packed whole, in float64; the engine's
log-probs, loss and optimizer step with the tree against without it, micro-batch splits
included; and what it refuses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from prefix_parity import rms_norm_in_input_dtype
from tensordict import TensorDict
from transformers import AutoModelForCausalLM

from areal_like.api.config import MicroBatchSpec, ModelConfig, OptimizerConfig, TrainEngineConfig
from areal_like.api.lora_config import LoRAConfig
from areal_like.utils.packed_logprobs import next_token_logprobs, shift_packed_to_next_token
from engines import FSDPEngine
from engines.fsdp.attention import PACKED_SDPA, packed_model_kwargs
from engines.fsdp.shared_prefix import build_prefix_tree, why_not_shared


def _groups(seed: int) -> list[torch.Tensor]:
    """GRPO-like groups: prompts of 5-19 tokens, answers of 1-7 drawn from 3 tokens (so
    samples often share more than the prompt), a one-sample group, an answer repeated
    exactly, two prompts that share their first tokens, a lone one-token sequence, and a
    multi-turn agent's per-turn sequences (each turn's is the history before it, then the
    turn: the whole of one sequence is the prefix of the next)."""
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    prompts = [torch.randint(3, 500, (int(torch.randint(5, 20, (1,), generator=gen)),),
                             generator=gen) for _ in range(4)]
    prompts.append(torch.cat([prompts[0][:4], torch.tensor([7, 8, 9])]))  # shares 4 tokens
    for g, prompt in enumerate(prompts):
        for _ in range(1 if g == 2 else 6):
            n = int(torch.randint(1, 8, (1,), generator=gen))
            seqs.append(torch.cat([prompt, torch.randint(3, 6, (n,), generator=gen)]))
    seqs.append(seqs[0].clone())  # the same sequence twice: wholly shared
    seqs.append(torch.tensor([42]))
    history = torch.randint(3, 500, (9,), generator=gen)
    for _ in range(3):  # turns: tool result + the model's reply appended to the history
        history = torch.cat([history, torch.randint(3, 500, (5,), generator=gen)])
        seqs.append(history.clone())
    return seqs


def _packed(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([len(s) for s in seqs])
    return torch.cat(seqs), torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])


def test_tree_equals_the_packed_forward_and_backward_in_float64(
        tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.models.qwen2 import modeling_qwen2

    monkeypatch.setattr(modeling_qwen2.Qwen2RMSNorm, "forward", rms_norm_in_input_dtype)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64,
                                                 attn_implementation=PACKED_SDPA)
    seqs = _groups(0)
    ids, cu = _packed(seqs)
    tree = build_prefix_tree(ids, cu)
    assert tree is not None
    # one row per distinct prefix, counted here from the sequences themselves
    assert tree.n_rows == len({tuple(s[:i + 1].tolist()) for s in seqs for i in range(len(s))})
    assert torch.equal(tree.input_ids[tree.unshared], ids)  # each token's row holds it
    depth = torch.cat([torch.arange(len(s)) for s in seqs])
    assert torch.equal(tree.position_ids[tree.unshared], depth)

    shared = model(input_ids=tree.input_ids[None], position_ids=tree.position_ids[None],
                   attention_mask=None, use_cache=False, tree_buckets=tree.attention).logits[0]
    shared = shared.index_select(0, tree.unshared)
    weights = torch.randn(shared.shape, generator=torch.Generator().manual_seed(1),
                          dtype=torch.float64)
    (shared * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    whole = model(input_ids=ids[None], position_ids=depth[None], attention_mask=None,
                  use_cache=False, **packed_model_kwargs(cu)).logits[0]
    (whole * weights).sum().backward()
    torch.testing.assert_close(shared, whole, atol=1e-10, rtol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-10, rtol=1e-9)


def test_nothing_shared_is_packed_whole() -> None:
    ids, cu = _packed([torch.arange(3, 13), torch.arange(20, 26), torch.arange(40, 47)])
    assert build_prefix_tree(ids, cu) is None  # the tree would keep every token
    assert build_prefix_tree(ids, cu, break_even=1.0) is not None


def _config(model_dir: Path, shared: bool, max_tokens: int, lora_rank: int) -> TrainEngineConfig:
    return TrainEngineConfig(model=ModelConfig(path=str(model_dir)),
                             optimizer=OptimizerConfig(lr=1e-3, gradient_clipping=1.0),
                             mb_spec=MicroBatchSpec(max_tokens_per_mb=max_tokens),
                             lora=LoRAConfig(rank=lora_rank), shared_prefix=shared)


def _padded(seqs: list[torch.Tensor]) -> TensorDict:
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, s in enumerate(seqs):  # left padding, as prompts come back from rollout
        ids[i, width - len(s):], attn[i, width - len(s):] = s, 1
    loss_mask = attn.clone()
    loss_mask[:, : width - 3] = 0  # the last three tokens are "the answer"
    return TensorDict({"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask},
                      batch_size=[len(seqs)])


def _mean_nll(logits: torch.Tensor, mb: TensorDict) -> torch.Tensor:
    mask = shift_packed_to_next_token(mb["loss_mask"], mb["cu_seqlens"]).bool()
    return -(next_token_logprobs(logits, mb) * mask).sum() / mask.sum().clamp(min=1)


def _loss_weight(mb: TensorDict) -> torch.Tensor:
    return shift_packed_to_next_token(mb["loss_mask"], mb["cu_seqlens"]).sum()


# one micro-batch; groups split across many; LoRA adapters
@pytest.mark.parametrize("max_tokens, lora_rank", [(4096, 0), (90, 0), (4096, 4)])
def test_engine_with_shared_prefixes_trains_as_without(tiny_model_dir: Path, max_tokens: int,
                                                       lora_rank: int) -> None:
    batch = _padded(_groups(2)[:-1])
    runs = {}
    for shared in (False, True):
        engine = FSDPEngine(_config(tiny_model_dir, shared, max_tokens, lora_rank))
        engine.initialize()
        try:
            logp = engine.forward(batch)
            stats = engine.train_batch(batch, _mean_nll, _loss_weight)
            params = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
                      for p in engine.model.parameters()]
        finally:
            engine.destroy()
        runs[shared] = (logp, stats, params)
    (logp, stats, params), (logp_t, stats_t, params_t) = runs[False], runs[True]
    torch.testing.assert_close(logp_t, logp, atol=1e-5, rtol=0)
    assert stats_t["loss"] == pytest.approx(stats["loss"], abs=1e-5)
    assert stats_t["grad_norm"] == pytest.approx(stats["grad_norm"], rel=1e-4)
    assert stats_t["n_tokens"] == stats["n_tokens"] and stats_t["n_mbs"] == stats["n_mbs"]
    assert stats_t["n_forwarded_tokens"] < 0.8 * stats["n_tokens"]
    assert "n_forwarded_tokens" not in stats
    # Adam's first step moves an element by lr * g / (|g| + eps): where g is near 0, float32
    # noise in g moves it by a few % of lr (1e-3); a wrong gradient moves it by up to 2 lr
    for p, q in zip(params_t, params, strict=True):
        torch.testing.assert_close(p, q, atol=5e-5, rtol=0)


def test_where_shared_prefixes_do_not_apply_and_why() -> None:
    for args, why in [((True, False, PACKED_SDPA), "vision-language"),
                      ((False, True, PACKED_SDPA), "router replay"),
                      ((False, False, "flash_attention_2"), "flash_attention_2")]:
        assert why in why_not_shared(*args, PACKED_SDPA)
    assert "sequence_parallel_size=2" in why_not_shared(False, False, PACKED_SDPA, PACKED_SDPA,
                                                        2)
    assert why_not_shared(False, False, PACKED_SDPA, PACKED_SDPA) == ""
