"""Shared pieces of the SGLang tests: engine factory, HF reference log-probs, weight copies."""

from __future__ import annotations

import json
import os
import shutil
import urllib.request
from functools import lru_cache
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from areal_like.api.config import RolloutConfig
from engines.remote_sglang import RemoteSGLangEngine

# SGLang computes in float32; the reference runs the same weights in float64. Measured max
# |diff| on the 1m model is ~1e-6; 1e-4 leaves room for float32 reduction-order noise.
LOGPROB_ATOL = 1e-4


def require_sglang_venv() -> None:
    """Skip when the SGLang venv is missing (fail in CI), like the `sglang_fleet` fixture."""
    from engines.sglang_server import SGLangServerError, resolve_sglang_python

    try:
        resolve_sglang_python(".venv-sglang")
    except SGLangServerError as e:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI must run the SGLang tests: {e}")
        pytest.skip(f"SGLang venv missing (run `make sglang`): {e}")


def make_engine(addresses: list[str], api_key: str | None, **config: object) -> RemoteSGLangEngine:
    engine = RemoteSGLangEngine(RolloutConfig(server_addrs=list(addresses), api_key=api_key,
                                              **config))  # type: ignore[arg-type]
    engine.initialize()
    return engine


@lru_cache(maxsize=4)
def _reference_model(model_dir: str) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    return model.eval()


def hf_logprobs(
    model_dir: str | Path, prompt: list[int], output: list[int],
    banned_token_ids: tuple[int, ...] = (),
) -> torch.Tensor:
    """float64 log p(output[i] | prompt + output[:i]) from an independent HF forward pass.

    `banned_token_ids` get probability 0 before normalising: SGLang reports the log-probs of
    the distribution it sampled from, and under `min_new_tokens` that one excludes EOS.
    """
    model = _reference_model(str(model_dir))
    ids = torch.tensor([list(prompt) + list(output)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    logits = logits[len(prompt) - 1 : -1]
    if banned_token_ids:
        logits[:, list(banned_token_ids)] = float("-inf")
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, torch.tensor(output)[:, None])[:, 0]


def eos_token_id(model_dir: str | Path) -> int:
    return int(AutoModelForCausalLM.from_pretrained(model_dir).config.eos_token_id)


def perturbed_copy(src: Path, dst: Path, seed: int, scale: float = 0.05) -> Path:
    """`src`'s model with every weight shifted by `scale`·N(0,1) noise, saved to `dst`."""
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    model.save_pretrained(dst)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    return dst


def fleet_version(addresses: list[str], api_key: str | None) -> int:
    """The weight version every server of the fleet reports (they must agree)."""
    versions = set()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    for addr in addresses:
        req = urllib.request.Request(f"http://{addr}/get_model_info", headers=headers)
        with urllib.request.urlopen(req, timeout=10) as resp:
            versions.add(int(json.load(resp)["weight_version"]))
    assert len(versions) == 1, f"servers disagree on the weight version: {versions}"
    return versions.pop()
