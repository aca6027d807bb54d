"""Single-process float64 references for the FSDP engine's torchrun tests: the plain HF model
(eager attention, padded rows, no packing, no sharding) trained as tests/fsdp_worker.py's
engines are configured."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import fsdp_worker as W
import torch
from transformers import AutoModelForCausalLM


def reference_steps(model_dir: Path, batches: list[dict[str, torch.Tensor]],
                    lora: Any = None
                    ) -> tuple[list[dict[str, float]], list[dict[str, torch.Tensor]],
                               list[dict[str, torch.Tensor]]]:
    """Per step: stats (loss, grad_norm, lr), the parameters after it, and the gradients it
    applied (after clipping). Global token-mean NLL of the next tokens where loss_mask of the
    predicted token is 1, clip to 1.0, AdamW, warm-up factor 0.5 then 1.0 (the worker's cosine
    schedule). With `lora` (a LoRAConfig): PEFT adapters on the frozen base, A drawn after
    `torch.manual_seed(0)` as the engine draws them, only they trained."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager")
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = get_peft_model(model, LoraConfig(
                r=lora.rank, lora_alpha=lora.alpha, target_modules=list(lora.target_modules),
                bias="none"))
    model = model.double()
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=W.LR, eps=W.ADAM_EPS, weight_decay=W.WEIGHT_DECAY)
    stats, snapshots, grads = [], [], []
    for factor, batch in zip([0.5, 1.0], batches, strict=True):
        ids, attn, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        logits = model(input_ids=ids, attention_mask=attn).logits
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        mask = (loss_mask[:, 1:] * attn[:, 1:]).bool()
        loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(params, 1.0))
        grads.append({n: p.grad.detach().clone() for n, p in zip(names, params, strict=True)})
        for group in opt.param_groups:
            group["lr"] = W.LR * factor
        opt.step()
        stats.append({"loss": loss.item(), "grad_norm": norm, "lr": W.LR * factor})
        snapshots.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return stats, snapshots, grads


def per_sequence_outputs(model_dir: Path, batch: dict[str, torch.Tensor],
                         critic_dir: Any = None) -> list[dict[str, torch.Tensor]]:
    """Each row through the plain float64 model on its own: next-token log-probs [n - 1] and
    entropies [n] (a critic folder: values [n])."""
    from transformers import AutoModelForTokenClassification

    model = (AutoModelForTokenClassification.from_pretrained(
        critic_dir, dtype=torch.float32, attn_implementation="eager") if critic_dir else
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                             attn_implementation="eager"))
    model = model.double().eval()
    rows = []
    ids, attn = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        for b in range(ids.shape[0]):
            seq = ids[b, : int(attn[b].sum())]
            out = model(input_ids=seq[None]).logits[0]
            if critic_dir:
                rows.append({"values": out[:, 0]})
                continue
            logp_all = torch.log_softmax(out, -1)
            rows.append({"logp": logp_all[:-1].gather(-1, seq[1:, None]).squeeze(-1),
                         "entropy": -(logp_all.exp() * logp_all).sum(-1)})
    return rows


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
