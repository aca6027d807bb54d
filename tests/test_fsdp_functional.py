"""Chunked log-prob / entropy helpers and packed attention, single process, against float64
references computed here with plain torch / transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tensordict import TensorDict
from transformers import AutoModelForCausalLM

from areal_like.utils.packed_logprobs import (
    DUMMY_LABEL,
    gather_logprobs,
    gather_logprobs_entropy,
    next_token_labels,
    next_token_logprobs,
    next_token_mask,
    shift_packed_to_next_token,
)
from engines.fsdp.attention import PACKED_SDPA, packed_model_kwargs
from engines.fsdp.attention import bucket_plan as attention_bucket_plan


def _reference(logits: torch.Tensor, labels: torch.Tensor, temperature: float):
    logp_all = torch.log_softmax(logits.double() / temperature, -1)
    logp = logp_all.gather(-1, labels[:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


@pytest.mark.parametrize("chunk_size,temperature", [(3, 1.0), (1024, 0.7)])
def test_logprobs_and_entropy_match_reference_values_and_gradients(
    chunk_size: int, temperature: float
) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(10, 37, generator=gen) * 3).requires_grad_()
    labels = torch.randint(0, 37, (10,), generator=gen)
    w_logp, w_ent = torch.randn(10, generator=gen), torch.randn(10, generator=gen)

    logp, ent = gather_logprobs_entropy(logits, labels, chunk_size, temperature)
    assert logp.dtype == ent.dtype == torch.float32
    ((logp * w_logp).sum() + (ent * w_ent).sum()).backward()
    grad = logits.grad.clone()

    ref_logits = logits.detach().double().requires_grad_()
    ref_logp, ref_ent = _reference(ref_logits, labels, temperature)
    ((ref_logp * w_logp.double()).sum() + (ref_ent * w_ent.double()).sum()).backward()
    torch.testing.assert_close(logp.double(), ref_logp.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), ref_ent.detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(grad.double(), ref_logits.grad, atol=1e-5, rtol=0)

    logits.grad = None
    only = gather_logprobs(logits, labels, chunk_size, temperature)
    torch.testing.assert_close(only, logp)
    (only * w_logp).sum().backward()
    ref_logits.grad = None
    (_reference(ref_logits, labels, temperature)[0] * w_logp.double()).sum().backward()
    torch.testing.assert_close(logits.grad.double(), ref_logits.grad, atol=1e-5, rtol=0)


def test_bf16_logits_are_upcast_per_chunk() -> None:
    logits = torch.randn(6, 50).bfloat16()
    labels = torch.randint(0, 50, (6,))
    logp = gather_logprobs(logits, labels, chunk_size=2)
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp.double(), _reference(logits.float(), labels, 1.0)[0],
                               atol=1e-5, rtol=0)


def test_bad_inputs_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"labels must be \[T\]"):
        gather_logprobs(torch.zeros(4, 5), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature=0"):
        gather_logprobs(torch.zeros(4, 5), torch.zeros(4, dtype=torch.long), temperature=0)


def test_next_token_labels_and_mask_stay_inside_each_sequence() -> None:
    ids = torch.tensor([10, 11, 12, 20, 21, 30])
    cu = torch.tensor([0, 3, 5, 6])
    assert next_token_labels(ids, cu).tolist() == [11, 12, DUMMY_LABEL, 21, DUMMY_LABEL,
                                                   DUMMY_LABEL]
    assert next_token_mask(cu).tolist() == [True, True, False, True, False, False]
    loss_mask = torch.tensor([0, 1, 1, 0, 1, 1])
    assert shift_packed_to_next_token(loss_mask, cu).tolist() == [1, 1, 0, 1, 0, 0]
    assert shift_packed_to_next_token(ids.float(), cu, fill=-1.0).tolist() == [11, 12, -1, 21, -1, -1]
    mb = TensorDict({"input_ids": ids, "cu_seqlens": cu}, batch_size=[])
    logits = torch.randn(6, 40)
    logp = next_token_logprobs(logits, mb)
    ref = torch.log_softmax(logits.double(), -1)
    assert logp[2] == 0 and logp[4] == 0 and logp[5] == 0
    torch.testing.assert_close(logp[0].double(), ref[0, 11])
    torch.testing.assert_close(logp[3].double(), ref[3, 21])


@pytest.mark.parametrize("lengths, bucketed", [
    ([5, 17, 1, 30], False),  # no two alike: one SDPA call per sequence
    # a GRPO-like pack: buckets {3, 9, 10} {20..22} {30, 31}, short rows padded in each
    ([20, 21, 3, 22, 20, 9, 21, 30, 10, 20, 31, 22], True),
])
def test_packed_attention_equals_per_sequence_forward_and_backward(
        tiny_model_dir: Path, lengths: list[int], bucketed: bool) -> None:
    packed = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                  attn_implementation=PACKED_SDPA)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                 attn_implementation="eager")
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 500, (n,), generator=gen) for n in lengths]
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()])
    plan = attention_bucket_plan(cu)
    assert (plan is not None) == bucketed
    if plan is not None:
        assert [b.length for b in plan.buckets] == [10, 22, 31]
    pos = torch.cat([torch.arange(n) for n in lengths])
    out = packed(input_ids=torch.cat(seqs)[None], position_ids=pos[None], attention_mask=None,
                 use_cache=False, **packed_model_kwargs(cu)).logits[0]
    out.pow(2).mean().backward()
    ref = torch.cat([plain(input_ids=s[None]).logits[0] for s in seqs])
    ref.pow(2).mean().backward()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)
    for (name, p), q in zip(packed.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)
    # without cu_seq_lens the function is ordinary (causal, unpacked) SDPA
    with torch.no_grad():
        whole = packed(input_ids=seqs[1][None]).logits[0]
    torch.testing.assert_close(whole, ref[int(cu[1]):int(cu[2])], atol=1e-5, rtol=0)
