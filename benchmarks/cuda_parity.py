"""FSDP2 on CUDA against transformers, and the trainer's NCCL weight-update end.

    python -m benchmarks.cuda_parity [--size 10m] [--throughput-size 100m] [--out DIR]

Needs a CUDA device (`--allow-cpu` runs the same code on CPU with gloo, to check the script).
1. Log-probs of packed sequences from `FSDPEngine.forward` (fp32; bf16 mixed precision; a bf16
   model) and from transformers (padded, SDPA; fp32 and bf16), each against a float64
   reference of the same weights. The FSDP2 engine passes where its error is within 2x that
   of transformers in the same dtype (+1e-3).
2. Two `train_batch` steps (token-mean NLL, AdamW with eps 1e-3 so an update follows the
   gradient smoothly, clip 1.0) against float64 training: loss, grad norm, parameters.
3. train_batch throughput, bf16 mixed precision against fp32 (the baseline, same run).
4. The NCCL weight-update group (`engines.weight_transport.process_group_trainer`): flattening
   buckets on the GPU, a one-rank NCCL group through the same rendezvous code, and a second
   process joining as the server's rank would (NCCL refuses two ranks on one GPU: then that
   is reported).
Weights are drawn with std 0.06 so logits spread (std printed) as a trained model's do.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from areal_like.api.config import MicroBatchSpec, ModelConfig, OptimizerConfig, TrainEngineConfig
from areal_like.api.io_struct import ParamSpec
from areal_like.models.tiny import build_tiny_model
from areal_like.utils.packed_logprobs import next_token_logprobs, shift_packed_to_next_token
from engines.fsdp.engine import FSDPEngine
from engines.fsdp.model_io import gather_full_state_dict
from engines.weight_transport.process_group_trainer import (
    WeightUpdateGroup,
    flatten_bucket,
    host_store,
    plan_buckets,
)

LR, ADAM_EPS = 1e-3, 1e-3
LENGTHS = [37, 5, 120, 64, 9, 200, 33, 81]


def make_model(out: Path, size: str, std: float = 0.06) -> Path:
    from transformers import AutoModelForCausalLM
    build_tiny_model(out, size)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.save_pretrained(out, safe_serialization=True)
    return out


def make_batch(seed: int, lengths: list[int], vocab: int) -> TensorDict:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    attn, loss_mask = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(3, vocab, (n,), generator=gen)
        attn[i, :n] = 1
        loss_mask[i, n // 3:n] = 1
    return TensorDict({"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask},
                      batch_size=[len(lengths)])


def nll_loss(logits: torch.Tensor, mb: TensorDict) -> torch.Tensor:
    mask = shift_packed_to_next_token(mb["loss_mask"], mb["cu_seqlens"]).bool()
    return -(next_token_logprobs(logits, mb) * mask).sum() / mask.sum().clamp(min=1)


def n_trained(mb: TensorDict) -> torch.Tensor:
    return shift_packed_to_next_token(mb["loss_mask"], mb["cu_seqlens"]).sum()


def hf_logprobs(model: Any, batch: TensorDict, device: torch.device) -> torch.Tensor:
    """[B, L] next-token log-probs of a padded forward (0 at each row's last token and after)."""
    ids, attn = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits.double()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    out = torch.zeros(ids.shape, dtype=torch.float64, device=device)
    out[:, :-1] = logp * attn[:, 1:]
    return out.cpu()


def engine(model_dir: Path, dtype: str = "float32", param_dtype: str = "float32",
           max_tokens: int = 4096) -> FSDPEngine:
    optim = OptimizerConfig(lr=LR, eps=ADAM_EPS, weight_decay=0.0, gradient_clipping=1.0,
                            lr_scheduler_type="constant")
    eng = FSDPEngine(TrainEngineConfig(
        model=ModelConfig(path=str(model_dir), dtype=dtype), optimizer=optim,
        mb_spec=MicroBatchSpec(max_tokens_per_mb=max_tokens), param_dtype=param_dtype,
        reduce_dtype="float32", total_train_steps=10))
    eng.initialize()
    return eng


def errors(logp: torch.Tensor, ref: torch.Tensor, batch: TensorDict) -> tuple[float, float]:
    mask = batch["attention_mask"].clone()
    mask[torch.arange(len(mask)), mask.sum(1) - 1] = 0  # the last token predicts nothing
    diff = (logp.double() - ref).abs()[mask.bool()]
    return float(diff.max()), float(diff.mean())


def reference_steps(model_dir: Path, batches: list[TensorDict], device: torch.device) -> dict:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager").double().to(device)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=LR, eps=ADAM_EPS, weight_decay=0.0)
    steps = []
    for batch in batches:
        ids, attn = batch["input_ids"].to(device), batch["attention_mask"].to(device)
        logits = model(input_ids=ids, attention_mask=attn).logits
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        mask = (batch["loss_mask"].to(device)[:, 1:] * attn[:, 1:]).bool()
        loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
        opt.step()
        steps.append({"loss": loss.item(), "grad_norm": norm})
    return {"steps": steps, "params": {k: v.detach().cpu() for k, v in
                                       model.state_dict().items()}}


def parity(model_dir: Path, device: torch.device) -> dict[str, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    batch = make_batch(1, LENGTHS, vocab)
    ref_model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager").double().to(device)
    ref = hf_logprobs(ref_model, batch, device)
    with torch.no_grad():
        logits = ref_model(input_ids=batch["input_ids"][:1].to(device)).logits
    logit_std = float(logits.std())
    del ref_model
    rows: dict[str, tuple[float, float]] = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype,
                                                  attn_implementation="sdpa").to(device)
        rows[f"transformers {name} (padded, sdpa)"] = errors(hf_logprobs(hf, batch, device),
                                                             ref, batch)
        del hf
    for name, kwargs in (("fp32", {}), ("bf16 mixed precision", {"param_dtype": "bfloat16"}),
                         ("bf16 model", {"dtype": "bfloat16", "param_dtype": "bfloat16"}),
                         ("bf16 mixed, 3 micro-batches", {"param_dtype": "bfloat16",
                                                          "max_tokens": 256})):
        eng = engine(model_dir, **kwargs)
        rows[f"FSDP2 {name} (packed, {eng.model.config._attn_implementation})"] = errors(
            eng.forward(batch).cpu(), ref, batch)
        eng.destroy()
    hf32 = rows["transformers float32 (padded, sdpa)"][0]
    hf16 = rows["transformers bfloat16 (padded, sdpa)"][0]
    verdicts = {k: v[0] <= 2 * (hf16 if "bf16" in k else hf32) + 1e-3
                for k, v in rows.items() if k.startswith("FSDP2")}

    batches = [make_batch(2, LENGTHS, vocab), make_batch(3, LENGTHS[::-1], vocab)]
    reference = reference_steps(model_dir, batches, device)
    train: dict[str, Any] = {"float64 reference": reference["steps"]}
    for name, kwargs in (("FSDP2 fp32", {}), ("FSDP2 bf16 mixed", {"param_dtype": "bfloat16"})):
        eng = engine(model_dir, **kwargs)
        steps = [eng.train_batch(b, nll_loss, n_trained) for b in batches]
        params = {k: v.cpu() for k, v in gather_full_state_dict(eng.model).items()}
        eng.destroy()
        train[name] = [{"loss": s["loss"], "grad_norm": s["grad_norm"]} for s in steps]
        train[name + " params max |diff|"] = max(
            float((params[k].double() - reference["params"][k]).abs().max()) for k in params)
    return {"logit_std": logit_std, "logprob_errors": rows, "verdicts": verdicts, "train": train}


def throughput(model_dir: Path, n_steps: int = 5) -> dict[str, float]:
    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(model_dir).vocab_size
    batch = make_batch(4, [512] * 64, vocab)
    n_tokens = int(batch["attention_mask"].sum())
    out = {}
    for name, kwargs in (("fp32", {}), ("bf16 mixed", {"param_dtype": "bfloat16"})):
        eng = engine(model_dir, max_tokens=8192, **kwargs)
        eng.train_batch(batch, nll_loss, n_trained)  # warm-up
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        sync()
        start = time.perf_counter()
        for _ in range(n_steps):
            eng.train_batch(batch, nll_loss, n_trained)
        sync()
        out[name] = n_steps * n_tokens / (time.perf_counter() - start)
        eng.destroy()
    return out


def _receiver(addr: str, port: int, name: str, sizes: list[int], backend: str,
              result: Any) -> None:
    """Joins as rank 1, the way SGLang's end does (a store client, the group-name prefix)."""
    from datetime import timedelta

    try:
        device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
        if backend == "nccl":
            torch.cuda.set_device(0)
        store = torch.distributed.TCPStore(addr, port, 2, False, timeout=timedelta(seconds=60))
        group = WeightUpdateGroup(name, store, 2, backend, timeout_s=60, rank=1)
        group.connect()
        sums = []
        for n in sizes:
            flat = torch.empty(n, dtype=torch.uint8, device=device)
            group.start_broadcast(flat).wait()
            sums.append(int(flat.to(torch.int64).sum()))
        result.put({"ok": True, "sums": sums})
    except Exception as e:  # noqa: BLE001 - reported to the parent
        result.put({"ok": False, "error": f"{type(e).__name__}: {str(e)[:400]}"})


def weight_group(model_dir: Path, device: torch.device) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM
    backend = "nccl" if device.type == "cuda" else "gloo"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device)
    tensors = dict(model.named_parameters())
    specs = [ParamSpec(k, "bfloat16", tuple(v.shape)) for k, v in tensors.items()]
    buckets = plan_buckets(specs, 64 << 20)
    total = sum(s.nbytes for s in specs)
    flats = [flatten_bucket([tensors[s.name] for s in b], device).clone() for b in buckets]
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for b in buckets:
        flatten_bucket([tensors[s.name] for s in b], device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    out: dict[str, Any] = {"bytes": total, "buckets": len(buckets),
                           "flatten_GBps": total / (time.perf_counter() - start) / 1e9}
    for world in (1, 2):
        name = f"parity_group_{world}"
        store, port = host_store("127.0.0.1", 60)
        ctx = mp.get_context("spawn")
        result = ctx.Queue()
        proc = None
        if world == 2:
            proc = ctx.Process(target=_receiver, args=("127.0.0.1", port, name,
                                                       [f.numel() for f in flats], backend,
                                                       result))
            proc.start()
        group = WeightUpdateGroup(name, store, world, backend, timeout_s=60)
        try:
            group.connect()
            start = time.perf_counter()
            for flat in flats:
                group.start_broadcast(flat).wait()
            if device.type == "cuda":
                torch.cuda.synchronize()
            row: dict[str, Any] = {"GBps": total / (time.perf_counter() - start) / 1e9}
            if proc is not None:
                got = result.get(timeout=120)
                expected = [int(f.to(torch.int64).sum()) for f in flats]
                row.update(got, bytes_match=got.get("sums") == expected)
        except Exception as e:  # noqa: BLE001 - reported in the table
            row = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
            if proc is not None and not result.empty():
                row["receiver"] = result.get()
        finally:
            group.destroy()
            if proc is not None:
                proc.join(timeout=30)
                if proc.is_alive():
                    proc.kill()
        out[f"{world}-rank {backend} group"] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="10m")
    parser.add_argument("--throughput-size", default="100m")
    parser.add_argument("--out", default=None, help="write results.json here")
    parser.add_argument("--allow-cpu", action="store_true")
    parser.add_argument("--skip", default="", help="comma list of parts to skip")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.allow_cpu:
        raise SystemExit("no CUDA device visible (pass --allow-cpu to check the script on CPU)")
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 in the comparison
    skip = set(args.skip.split(","))
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if device.type == "cuda"
                               else "cpu", "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        small = make_model(Path(tmp) / args.size, args.size)
        if "parity" not in skip:
            results["parity"] = parity(small, device)
        if "weights" not in skip:
            results["weight_group"] = weight_group(small, device)
        if "throughput" not in skip:
            big = make_model(Path(tmp) / args.throughput_size, args.throughput_size)
            results["throughput_tokens_per_s"] = throughput(big)
    print(json.dumps(results, indent=1))
    print_tables(results)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "results.json").write_text(json.dumps(results, indent=1))


def print_tables(results: dict[str, Any]) -> None:
    print(f"\ndevice: {results['device']}, torch {results['torch']}")
    if "parity" in results:
        p = results["parity"]
        print(f"\nlog-probs vs float64 (logit std {p['logit_std']:.2f})")
        print("| path | max abs diff | mean abs diff | within 2x transformers |")
        print("|---|---|---|---|")
        for k, (mx, mean) in p["logprob_errors"].items():
            print(f"| {k} | {mx:.2e} | {mean:.2e} | {p['verdicts'].get(k, '')} |")
        print("\ntrain steps vs float64")
        for k, v in p["train"].items():
            print(f"| {k} | {v} |")
    if "throughput_tokens_per_s" in results:
        t = results["throughput_tokens_per_s"]
        print("\n| train_batch | tokens/s | ratio vs fp32 |\n|---|---|---|")
        for k, v in t.items():
            print(f"| {k} | {v:,.0f} | {v / t['fp32']:.2f} |")
    if "weight_group" in results:
        print("\nweight-update group:", json.dumps(results["weight_group"]))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
