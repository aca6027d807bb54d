"""A single-process reference TrainEngine for the algorithm tests, and batch helpers.

`RefEngine` follows the TrainEngine contract with plain PyTorch: it packs padded batches with
`engines.fsdp.packing` under a small token budget (several micro-batches), runs the tiny HF
model one packed sequence at a time (exactly what packed attention computes), and combines
micro-batch losses with `loss_weight_fn` weights. Imported by tests/test_algo_actors*.py.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict
from transformers import AutoModelForCausalLM

from areal_like.api.engine_api import TrainEngine
from areal_like.utils.packed_logprobs import next_token_logprobs
from engines.fsdp.packing import (
    count_micro_batches,
    pack_sequences,
    partition_into_micro_batches,
    sequence_lengths,
    unpack_to_padded,
)


class RefEngine(TrainEngine):
    def __init__(self, model: torch.nn.Module, lr: float = 0.0, max_tokens_per_mb: int = 40,
                 adam: bool = False) -> None:
        self.model, self.cap, self.version = model, max_tokens_per_mb, 0
        opt = torch.optim.AdamW if adam else torch.optim.SGD
        self.opt = opt(model.parameters(), lr=lr)
        self.n_micro_batches = 0

    def initialize(self) -> None:
        pass

    def train(self, mode: bool = True) -> RefEngine:
        self.model.train(mode)
        return self

    def _mbs(self, batch: TensorDict) -> list[TensorDict]:
        lengths = sequence_lengths(batch["attention_mask"]).tolist()
        groups = partition_into_micro_batches(lengths, self.cap,
                                              count_micro_batches(lengths, self.cap))
        return [(g, pack_sequences(batch, g)) for g in groups if g]

    def _logits(self, mb: TensorDict) -> torch.Tensor:
        cu = mb["cu_seqlens"].tolist()
        out = [self.model(input_ids=mb["input_ids"][a:b][None]).logits[0]
               for a, b in zip(cu[:-1], cu[1:], strict=True)]
        return torch.cat(out).squeeze(-1) if out[0].shape[-1] == 1 else torch.cat(out)

    @torch.no_grad()
    def forward(self, batch, post_hook=None, aggregate_fn=None):
        hook = post_hook or next_token_logprobs
        per_row = {}
        for rows, mb in self._mbs(batch):
            out = hook(self._logits(mb), mb)
            for row, piece in zip(rows, out.split(mb["cu_seqlens"].diff().tolist()), strict=True):
                per_row[row] = piece
        values = [per_row[i] for i in range(batch.shape[0])]
        return aggregate_fn(values) if aggregate_fn else unpack_to_padded(
            values, batch["attention_mask"])

    def _run(self, batch, loss_fn, loss_weight_fn, train: bool) -> dict[str, float]:
        mbs = self._mbs(batch)
        self.n_micro_batches = len(mbs)
        weights = [float(loss_weight_fn(mb)) for _, mb in mbs]
        total, out = sum(weights), 0.0
        self.opt.zero_grad()
        for (_, mb), w in zip(mbs, weights, strict=True):
            loss = loss_fn(self._logits(mb), mb)
            out += float(loss.detach()) * w / total
            if train:
                (loss * w / total).backward()
        if train:
            self.opt.step()
        return {"loss": out}

    def train_batch(self, batch, loss_fn, loss_weight_fn):
        return self._run(batch, loss_fn, loss_weight_fn, True)

    def eval_batch(self, batch, loss_fn, loss_weight_fn):
        with torch.no_grad():
            return self._run(batch, loss_fn, loss_weight_fn, False)

    def save(self, meta) -> None:
        raise NotImplementedError

    def load(self, meta) -> None:
        raise NotImplementedError

    def update_weights(self, meta):
        raise NotImplementedError

    def step_lr_scheduler(self) -> None:
        pass

    def set_version(self, version: int) -> None:
        self.version = version

    def get_version(self) -> int:
        return self.version


def _model(path, dtype=torch.float64):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(path).to(dtype)


def _true_logprobs(model, ids, n):
    """[n] log p(ids[t] | ids[<t]) in token alignment (t = 0 gets 0), float64."""
    with torch.no_grad():
        logits = model(input_ids=ids[None, :n]).logits[0].double()
    lp = torch.log_softmax(logits, -1)
    out = torch.zeros(n, dtype=torch.float64)
    out[1:] = lp[:-1].gather(-1, ids[1:n, None]).squeeze(-1)
    return out


def _batch(model, n_rows=8, group=4, seed=0, noise=0.0, dense=False):
    """Right-padded trajectories with behaviour log-probs from `model` (+ noise)."""
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(2, 5, (n_rows,), generator=g)
    rlen = torch.randint(1, 7, (n_rows,), generator=g)
    L = int((plen + rlen).max())
    ids = torch.randint(3, 500, (n_rows, L), generator=g)
    attn = torch.zeros(n_rows, L, dtype=torch.bool)
    loss_mask = torch.zeros_like(attn)
    logprobs = torch.zeros(n_rows, L)
    for i in range(n_rows):
        n = int(plen[i] + rlen[i])
        attn[i, :n], loss_mask[i, plen[i]:n] = True, True
        lp = _true_logprobs(model, ids[i], n)
        logprobs[i, :n] = torch.where(loss_mask[i, :n], lp + noise * torch.randn(
            n, generator=g, dtype=torch.float64), 0.0).float()
    ids = torch.where(attn, ids, 0)
    if dense:  # an untrained hole inside the response (e.g. a tool's output between actions)
        holes = (rlen >= 3).nonzero()[:, 0]
        loss_mask[holes, plen[holes] + 1] = False
        logprobs[holes, plen[holes] + 1] = 0.0
    rewards = torch.randint(0, 2, (n_rows,), generator=g).float()
    rewards[:group] = torch.tensor([1.0, 0.0, 0.0, 0.0])[:group]
    if dense:
        rewards = torch.where(loss_mask & (torch.rand(n_rows, L, generator=g) > 0.5),
                              torch.randn(n_rows, L, generator=g), 0.0)
    versions = torch.where(loss_mask, 0, -1)
    return TensorDict({"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask,
                       "logprobs": logprobs, "versions": versions, "rewards": rewards,
                       "group_id": torch.arange(n_rows) // group}, batch_size=[n_rows])


def _grads(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])




def test_ref_engine_forward_is_the_per_row_next_token_logprob(tiny_model_dir):
    model = _model(tiny_model_dir)
    batch = _batch(model)
    out = RefEngine(model, max_tokens_per_mb=24).forward(batch)
    for i in range(batch.shape[0]):
        n = int(batch["attention_mask"][i].sum())
        want = _true_logprobs(model, batch["input_ids"][i], n)
        # position t holds log p(token t+1); the last real position and padding hold 0
        torch.testing.assert_close(out[i, :n - 1].double(), want[1:], rtol=0, atol=2e-6)
        assert (out[i, n - 1:] == 0).all()
