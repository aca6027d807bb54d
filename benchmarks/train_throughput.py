"""Train throughput: FSDPEngine.train_batch against a bare training loop, packing vs padding.

    OMP_NUM_THREADS=1 python benchmarks/train_throughput.py [--size 10m] [--steps 3]

One process (the engine makes a one-rank gloo group). Four ways to take the same optimizer
step on the same long-tailed batch, interleaved round by round so machine noise hits all alike:
  bare-packed   plain HF model + AdamW on the engine's packed micro-batches (the baseline)
  engine        FSDPEngine.train_batch (FSDP2, packing, weighting, clipping)
  bare-padded   plain HF model + AdamW on padded [n, L_max] micro-batches (HF attention mask),
                same number of micro-batches, rows in arrival order
  dense-mask    bare-packed, but with transformers' SDPA path, which isolates the packed
                sequences with a dense T x T block-diagonal mask instead of our packed SDPA
Throughput counts real (non-padding) tokens only. Two clocks per step: wall time (best round)
and this process's CPU time (median round). On a shared machine the CPU time measures the work
a method does without the time it spent descheduled, so the ratios use it; everything runs on
one thread (gloo's helper threads are counted too). Goal: engine >= 90 % of bare-packed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Callable

import torch
from tensordict import TensorDict
from transformers import AutoModelForCausalLM

from areal_like.api.config import MicroBatchSpec, ModelConfig, OptimizerConfig, TrainEngineConfig
from areal_like.models.tiny import build_tiny_model
from areal_like.utils.packed_logprobs import (
    gather_logprobs,
    next_token_logprobs,
    shift_packed_to_next_token,
)
from engines.fsdp.attention import PACKED_SDPA, packed_model_kwargs
from engines.fsdp.engine import FSDPEngine
from engines.fsdp.packing import (
    count_micro_batches,
    pack_sequences,
    partition_into_micro_batches,
    sequence_lengths,
)


def long_tailed_batch(n_seqs: int, vocab: int, max_len: int, seed: int) -> TensorDict:
    """Log-normal lengths (median ~max_len/8, clipped to [8, max_len]): mostly short rows, a few
    long ones, like RL rollouts. Right-padded; the first quarter of each row is a prompt."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.exp(torch.randn(n_seqs, generator=gen) * 0.8 + torch.log(
        torch.tensor(max_len / 8.0))).long().clamp(8, max_len).tolist()
    ids = torch.zeros(n_seqs, max(lengths), dtype=torch.long)
    attn = torch.zeros_like(ids)
    loss_mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(3, vocab, (n,), generator=gen)
        attn[i, :n] = 1
        loss_mask[i, n // 4:n] = 1
    return TensorDict({"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask},
                      batch_size=[n_seqs])


def nll_loss(logits: torch.Tensor, mb: TensorDict) -> torch.Tensor:
    mask = shift_packed_to_next_token(mb["loss_mask"], mb["cu_seqlens"]).bool()
    return -(next_token_logprobs(logits, mb) * mask).sum() / mask.sum().clamp(min=1)


def n_trained(mb: TensorDict) -> torch.Tensor:
    return shift_packed_to_next_token(mb["loss_mask"], mb["cu_seqlens"]).sum()


def bare_step_fn(model_dir: str, batch: TensorDict, groups: list[list[int]], cfg: OptimizerConfig,
                 layout: str) -> Callable[[], None]:
    """One plain fwd+bwd(+clip)+AdamW step over the given micro-batches, same global loss.
    layout: "packed" (packed SDPA), "packed-dense" (packed rows, transformers' own SDPA path,
    which builds a dense block-diagonal mask from position_ids) or "padded"."""
    padded = layout == "padded"
    impl = PACKED_SDPA if layout == "packed" else "sdpa"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation=impl)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, eps=cfg.eps)
    mbs = [pack_sequences(batch, g) for g in groups]
    total = float(sum(n_trained(mb) for mb in mbs))
    rows = [batch[torch.as_tensor(g)] for g in groups]

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        for mb, sub in zip(mbs, rows, strict=True):
            if padded:
                n = int(sub["attention_mask"].sum(-1).max())
                ids, attn = sub["input_ids"][:, :n], sub["attention_mask"][:, :n]
                logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits
                logp = gather_logprobs(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                       ids[:, 1:].reshape(-1))
                mask = (sub["loss_mask"][:, 1:n] * attn[:, 1:]).reshape(-1)
                loss = -(logp * mask).sum()
            else:
                kwargs = packed_model_kwargs(mb["cu_seqlens"]) if impl == PACKED_SDPA else {}
                logits = model(input_ids=mb["input_ids"][None],
                               position_ids=mb["position_ids"][None], attention_mask=None,
                               use_cache=False, **kwargs).logits[0]
                loss = nll_loss(logits, mb) * n_trained(mb)
            (loss / total).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.gradient_clipping)
        opt.step()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="10m", choices=["1m", "10m", "50m"])
    parser.add_argument("--n-seqs", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--max-tokens-per-mb", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=1, help="timed steps per method per round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    model_dir = build_tiny_model(tempfile.mkdtemp(prefix="bench_train_"), size=args.size, seed=1)
    vocab = AutoModelForCausalLM.from_pretrained(model_dir).config.vocab_size
    batch = long_tailed_batch(args.n_seqs, vocab, args.max_len, seed=0)
    lengths = sequence_lengths(batch["attention_mask"]).tolist()
    n_real = sum(lengths)
    optim = OptimizerConfig(lr=1e-5, gradient_clipping=1.0)
    spec = MicroBatchSpec(max_tokens_per_mb=args.max_tokens_per_mb)
    count = count_micro_batches(lengths, spec.max_tokens_per_mb, spec.n_mbs)
    packed_groups = partition_into_micro_batches(lengths, spec.max_tokens_per_mb, count)
    # padded baseline: the same number of micro-batches, rows in arrival order
    per = -(-len(lengths) // count)
    padded_groups = [list(range(i, min(i + per, len(lengths))))
                     for i in range(0, len(lengths), per)]
    padded_slots = sum(len(g) * max(lengths[i] for i in g) for g in padded_groups)

    engine = FSDPEngine(TrainEngineConfig(model=ModelConfig(path=str(model_dir)), optimizer=optim,
                                          mb_spec=spec))
    engine.initialize()
    methods = {
        "bare-packed": bare_step_fn(str(model_dir), batch, packed_groups, optim, "packed"),
        "engine": lambda: engine.train_batch(batch, nll_loss, n_trained),
        "bare-padded": bare_step_fn(str(model_dir), batch, padded_groups, optim, "padded"),
        "dense-mask": bare_step_fn(str(model_dir), batch, packed_groups, optim, "packed-dense"),
    }
    for fn in methods.values():  # warm-up
        fn()
    wall: dict[str, list[float]] = {name: [] for name in methods}
    cpu: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    for r in range(args.rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:  # rotate the order: no method always first
            fn = methods[name]
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(args.steps):
                fn()
            wall[name].append((time.perf_counter() - start) / args.steps)
            cpu[name].append((time.process_time() - start_cpu) / args.steps)
    engine.destroy()

    n_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
    print(f"model {args.size} ({n_params / 1e6:.1f}M params), {args.n_seqs} sequences, "
          f"{n_real} real tokens (lengths {min(lengths)}..{max(lengths)}, median "
          f"{int(statistics.median(lengths))}), {count} micro-batches of <= "
          f"{args.max_tokens_per_mb} tokens; padded layout holds {padded_slots} slots "
          f"({100 * (1 - n_real / padded_slots):.0f} % padding); threads={args.threads}, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
    c = {name: statistics.median(ts) for name, ts in cpu.items()}
    w = {name: min(ts) for name, ts in wall.items()}
    print(f"{'method':<12} {'cpu s/step':>10} {'tok/cpu-s':>10} {'vs bare-packed':>15} "
          f"{'wall s/step':>12} {'tok/s':>7} {'vs bare-packed':>15}")
    for name in methods:
        print(f"{name:<12} {c[name]:>10.3f} {n_real / c[name]:>10.0f} "
              f"{c['bare-packed'] / c[name]:>14.2f}x {w[name]:>12.3f} {n_real / w[name]:>7.0f} "
              f"{w['bare-packed'] / w[name]:>14.2f}x")
    print(f"packing vs padding (engine / bare-padded): {c['bare-padded'] / c['engine']:.2f}x "
          f"by CPU time, {w['bare-padded'] / w['engine']:.2f}x by wall time")
    print(f"packed SDPA vs dense block mask (dense-mask / bare-packed): "
          f"{c['dense-mask'] / c['bare-packed']:.2f}x by CPU time, "
          f"{w['dense-mask'] / w['bare-packed']:.2f}x by wall time")


if __name__ == "__main__":
    main()
