"""Tiny offline models: determinism, HF loading, tokenizer round-trips, chat template."""

from __future__ import annotations

import hashlib
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal_like.models.tiny import IM_END, IM_START, build_tiny_model


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.iterdir()) if p.is_file()}


def test_build_is_deterministic_for_a_seed(tmp_path):
    a = _digest(build_tiny_model(tmp_path / "a", "1m", seed=3))
    b = _digest(build_tiny_model(tmp_path / "b", "1m", seed=3))
    c = _digest(build_tiny_model(tmp_path / "c", "1m", seed=4))
    assert a == b
    assert a["model.safetensors"] != c["model.safetensors"]


@pytest.mark.parametrize("size, lo, hi", [("1m", 0.5e6, 2e6), ("10m", 5e6, 15e6)])
def test_sizes_load_with_auto_classes(tmp_path, size, lo, hi):
    folder = build_tiny_model(tmp_path / size, size, seed=1)
    model = AutoModelForCausalLM.from_pretrained(folder)
    n_params = sum(p.numel() for p in model.parameters())
    assert lo < n_params < hi
    tok = AutoTokenizer.from_pretrained(folder)
    ids = torch.tensor([tok.encode("What is 12 + 34?")])
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_cli_writes_a_loadable_folder(tmp_path):
    out = tmp_path / "cli"
    proc = subprocess.run(
        [sys.executable, "-m", "areal_like.models.tiny", "--out", str(out), "--size", "1m",
         "--seed", "2"], capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "wrote 1m qwen2 model" in proc.stdout
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}


def test_cli_writes_a_mixture_of_experts_on_the_same_tokenizer(tmp_path, tiny_model_dir):
    import json

    out = tmp_path / "moe"
    proc = subprocess.run(
        [sys.executable, "-m", "areal_like.models.tiny", "--out", str(out), "--arch",
         "qwen3_moe"], capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "wrote 1m qwen3_moe model (1.51M params)" in proc.stdout
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["num_experts_per_tok"]) == ("qwen3_moe", 2)
    assert config.get("num_experts", config.get("num_local_experts")) == 8
    assert (out / "tokenizer.json").read_text() == (tiny_model_dir / "tokenizer.json").read_text()
    with pytest.raises(ValueError, match="unknown tiny model arch 'mixtral'"):
        build_tiny_model(tmp_path / "x", arch="mixtral")


def test_unknown_size_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="'3m'"):
        build_tiny_model(tmp_path, "3m")


def test_tokenizer_round_trips_random_strings(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    rng = random.Random(0)
    alphabet = "abcXYZ0123456789 \t\n+-*/=?!.,#:;'\"()[]{}<>|_éß中"
    samples = ["", " ", "  leading", "trailing  ", "a\n\nb", "\t\t1 2  3", "0000", "9" * 40]
    samples += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 60)))
                for _ in range(250)]
    for text in samples:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text, repr(text)


def test_digits_are_single_tokens(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    pieces = tok.convert_ids_to_tokens(tok.encode("12345+678", add_special_tokens=False))
    digits = [p for p in pieces if any(ch.isdigit() for ch in p)]
    assert digits == list("12345678")


def test_chatml_template_and_special_tokens(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tok.apply_chat_template([{"role": "user", "content": "What is 1 + 2?"}],
                                   tokenize=False, add_generation_prompt=True)
    assert text == f"{IM_START}user\nWhat is 1 + 2?{IM_END}\n{IM_START}assistant\n"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids.count(tok.convert_tokens_to_ids(IM_START)) == 2
    assert tok.eos_token == IM_END and tok.eos_token_id == tok.convert_tokens_to_ids(IM_END)
    assert tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id
