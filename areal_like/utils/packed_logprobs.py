"""Per-token log-probabilities and entropies from logits, for packed 1-D sequences.

Label convention (packed layout, used by the train engine and by algorithms):
a micro-batch holds several sequences concatenated into 1-D tensors of T tokens, with
`cu_seqlens` = [0, len_0, len_0 + len_1, ..., T]. The *label* of token t is token t+1 of the
same sequence ("next token"); the last token of every sequence has no next token, so it gets
a dummy label (`DUMMY_LABEL` = 0, a valid index) and must be masked out
(`next_token_mask` is False there). `next_token_logprobs` therefore returns, at position t,
log p(token t+1 | tokens <= t), and 0.0 at the last token of each sequence. The same
"shifted by one" convention applies to the padded [B, L] layout that `FSDPEngine.forward`
returns: out[b, t] scores token t+1 of row b. Data indexed by token (entry i describes token i,
e.g. a rollout's `loss_mask` or `logprobs`) is brought to this alignment with
`shift_packed_to_next_token` (packed) or `torch.roll(x, -1, dims=-1)` (right-padded rows).

`gather_logprobs` / `gather_logprobs_entropy` work in chunks of `chunk_size` tokens: at most
one [chunk_size, V] float32 block exists at a time, in the forward and in the backward pass
(the backward recomputes the softmax from the saved logits instead of storing a float copy).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from tensordict import TensorDict

DUMMY_LABEL = 0
DEFAULT_CHUNK_SIZE = 1024


class _ChunkedLogProbs(torch.autograd.Function):
    """log_softmax(logits / temperature).gather(labels) (+ entropy), chunked over tokens."""

    @staticmethod
    def forward(ctx, logits, labels, chunk_size, temperature, with_entropy):
        n = logits.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        ent = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=logits.device)
        for s in range(0, n, chunk_size):
            x = logits[s:s + chunk_size].float() / temperature
            chunk_lse = torch.logsumexp(x, dim=-1)
            lse[s:s + chunk_size] = chunk_lse
            picked = x.gather(-1, labels[s:s + chunk_size, None]).squeeze(-1)
            logp[s:s + chunk_size] = picked - chunk_lse
            if with_entropy:
                p = torch.exp(x - chunk_lse[:, None])
                ent[s:s + chunk_size] = chunk_lse - (p * x).sum(-1)
        ctx.save_for_backward(logits, labels, lse)
        ctx.chunk_size, ctx.temperature, ctx.with_entropy = chunk_size, temperature, with_entropy
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        logits, labels, lse = ctx.saved_tensors
        chunk, temp = ctx.chunk_size, ctx.temperature
        grad_logits = torch.empty_like(logits)
        for s in range(0, logits.shape[0], chunk):
            x = logits[s:s + chunk].float() / temp
            chunk_lse = lse[s:s + chunk, None]
            p = torch.exp(x - chunk_lse)
            g = grad_logp[s:s + chunk, None].float()
            # d logp_label / dx = onehot(label) - p
            grad_x = -p * g
            grad_x.scatter_add_(-1, labels[s:s + chunk, None], g)
            if ctx.with_entropy and grad_ent is not None:
                # H = lse - sum p x  =>  dH/dx_j = -p_j (log p_j + H)
                log_p = x - chunk_lse
                h = -(p * log_p).sum(-1, keepdim=True)
                grad_x -= p * (log_p + h) * grad_ent[s:s + chunk, None].float()
            grad_logits[s:s + chunk] = (grad_x / temp).to(logits.dtype)
        return grad_logits, None, None, None, None


def _check_inputs(logits: torch.Tensor, labels: torch.Tensor, chunk_size: int,
                  temperature: float) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [T, V], got shape {tuple(logits.shape)}")
    if labels.shape != logits.shape[:1]:
        raise ValueError(
            f"labels must be [T] = {tuple(logits.shape[:1])} like logits, got {tuple(labels.shape)}"
        )
    if labels.dtype.is_floating_point:
        raise ValueError(f"labels must be integer token ids, got dtype {labels.dtype}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0")


def gather_logprobs(logits: torch.Tensor, labels: torch.Tensor,
                    chunk_size: int = DEFAULT_CHUNK_SIZE, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / temperature)[t, labels[t]] for logits [T, V], labels [T] -> float32 [T].

    Differentiable; memory beyond `logits` itself is one [chunk_size, V] float32 block."""
    _check_inputs(logits, labels, chunk_size, temperature)
    logp, _ = _ChunkedLogProbs.apply(logits, labels.long(), chunk_size, float(temperature), False)
    return logp


def gather_logprobs_entropy(
    logits: torch.Tensor, labels: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs of `labels`, entropy of the whole distribution), both float32 [T] and both
    differentiable, computed from logits / temperature in chunks like `gather_logprobs`."""
    _check_inputs(logits, labels, chunk_size, temperature)
    return _ChunkedLogProbs.apply(logits, labels.long(), chunk_size, float(temperature), True)


def shift_packed_to_next_token(values: torch.Tensor, cu_seqlens: torch.Tensor,
                        fill: float | int = 0) -> torch.Tensor:
    """Packed per-token [T, ...] values -> out[t] = values[t+1] of the same sequence, `fill` at
    each sequence's last token. Aligns token-indexed data (a rollout's `loss_mask`, `logprobs`,
    `versions`, with entry i describing token i) with the next-token outputs of the engine."""
    out = torch.roll(values, shifts=-1, dims=0)
    ends = cu_seqlens[1:].long() - 1
    out[ends[ends >= 0]] = fill
    return out


def next_token_labels(input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Packed [T] ids -> [T] labels: token t+1 of the same sequence; DUMMY_LABEL at each
    sequence's last token (mask it with `next_token_mask`)."""
    return shift_packed_to_next_token(input_ids, cu_seqlens, DUMMY_LABEL)


def next_token_mask(cu_seqlens: torch.Tensor, n_tokens: Optional[int] = None) -> torch.Tensor:
    """Bool [T]: True where token t has a next token in its sequence (False at sequence ends)."""
    n = int(cu_seqlens[-1]) if n_tokens is None else n_tokens
    mask = torch.ones(n, dtype=torch.bool, device=cu_seqlens.device)
    ends = cu_seqlens[1:].long() - 1
    mask[ends[ends >= 0]] = False
    return mask


def next_token_logprobs(logits: torch.Tensor, micro_batch: TensorDict, temperature: float = 1.0,
                        chunk_size: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    """A `post_hook` / loss building block: [T] log-probs of the next tokens of a packed
    micro-batch (0.0 at every sequence's last token). Use functools.partial for temperature."""
    cu = micro_batch["cu_seqlens"]
    labels = next_token_labels(micro_batch["input_ids"], cu)
    logp = gather_logprobs(logits, labels, chunk_size, temperature)
    return logp * next_token_mask(cu, logp.shape[0])


def next_token_logprobs_entropy(
    logits: torch.Tensor, micro_batch: TensorDict, temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like `next_token_logprobs`, plus the entropy of the distribution at each position
    (entropy is kept at sequence ends: it does not depend on a label)."""
    cu = micro_batch["cu_seqlens"]
    labels = next_token_labels(micro_batch["input_ids"], cu)
    logp, ent = gather_logprobs_entropy(logits, labels, chunk_size, temperature)
    return logp * next_token_mask(cu, logp.shape[0]), ent
