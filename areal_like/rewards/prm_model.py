"""A tiny process reward model (PRM): a token-classification head on a tiny Qwen2.

The model reads `prompt + step_1 + ... + step_k`, each part tokenized on its own (so a
step's last token is the last id of its part, the same in training and serving), and at the
last token of each step classifies it: label 1 = every step so far is correct. The step
score is p(label 1) there.

    build_prm(out)                           # random weights, tiny tokenizer, num_labels=2
    train_prm(out, examples, seconds=60)     # examples: (prompt, steps, labels)
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Sequence

import torch
from transformers import (
    AutoModelForTokenClassification,
    AutoTokenizer,
    PreTrainedTokenizerBase,
    Qwen2ForTokenClassification,
)

from areal_like.models.tiny import SIZES, build_config, build_tokenizer

PRMExample = tuple[str, Sequence[str], Sequence[int]]


def encode_steps(tokenizer: PreTrainedTokenizerBase, prompt: str,
                 steps: Sequence[str]) -> tuple[list[int], list[int]]:
    """(ids of prompt + steps, index of each step's last token)."""
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    ends = []
    for k, step in enumerate(steps):
        part = tokenizer.encode(step, add_special_tokens=False)
        if not part:
            raise ValueError(f"step {k} ({step!r}) has no tokens")
        ids += part
        ends.append(len(ids) - 1)
    return ids, ends


def build_prm(out: str | Path, size: str = "1m", seed: int = 1,
              init_from: str | Path | None = None) -> Path:
    """Write a 2-label token-classification Qwen2 + tokenizer to `out`: randomly initialised
    (tiny tokenizer), or the backbone and tokenizer of the causal LM at `init_from` (e.g. the
    policy's SFT warm start, which already reads the task) with a new score head."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    if init_from is not None:
        model = Qwen2ForTokenClassification.from_pretrained(init_from, num_labels=2)
        tokenizer = AutoTokenizer.from_pretrained(init_from)
    else:
        if size not in SIZES:
            raise ValueError(f"unknown PRM size {size!r}; choose one of {sorted(SIZES)}")
        tokenizer = build_tokenizer(SIZES[size][0], seed)
        config = build_config(size, tokenizer)
        config.num_labels = 2
        model = Qwen2ForTokenClassification(config)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def _batch(tokenizer: PreTrainedTokenizerBase, examples: Sequence[PRMExample]
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    encoded = [encode_steps(tokenizer, p, s) for p, s, _ in examples]
    width = max(len(ids) for ids, _ in encoded)
    pad = tokenizer.pad_token_id or 0
    ids = torch.full((len(examples), width), pad, dtype=torch.long)
    attn = torch.zeros((len(examples), width), dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)  # -100: no loss
    for i, ((row, ends), (_, steps, labs)) in enumerate(zip(encoded, examples, strict=True)):
        if len(labs) != len(steps):
            raise ValueError(f"example {i}: {len(labs)} labels for {len(steps)} steps")
        ids[i, :len(row)] = torch.tensor(row)
        attn[i, :len(row)] = 1
        labels[i, ends] = torch.tensor(list(labs))
    return ids, attn, labels


def train_prm(path: str | Path, examples: Sequence[PRMExample], seconds: float,
              batch_size: int = 32, lr: float = 5e-4, seed: int = 1) -> dict[str, float]:
    """Train the PRM at `path` in place for about `seconds` (cross-entropy on step-end
    tokens); returns {"steps", "loss"} of the last batch."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForTokenClassification.from_pretrained(path)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(seed)
    deadline, steps, loss = time.monotonic() + seconds, 0, float("nan")
    while time.monotonic() < deadline:
        ids, attn, labels = _batch(tokenizer, rng.sample(list(examples), batch_size))
        out = model(input_ids=ids, attention_mask=attn, labels=labels)
        opt.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        steps, loss = steps + 1, float(out.loss.detach())
    model.save_pretrained(path, safe_serialization=True)
    return {"steps": float(steps), "loss": loss}


@torch.no_grad()
def step_scores(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, prompt: str,
                steps: Sequence[str]) -> list[float]:
    """p(label 1) at the last token of every step."""
    ids, ends = encode_steps(tokenizer, prompt, steps)
    logits = model(input_ids=torch.tensor([ids])).logits[0]  # [T, 2]
    probs = torch.softmax(logits.double(), dim=-1)[:, 1]
    return [float(probs[e]) for e in ends]
