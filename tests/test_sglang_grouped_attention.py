"""The SGLang shim's grouped CPU attention (engines/sglang/shim/areal_like_sglang_attention.py).

Checked three ways: against SGLang's own per-request loop, bit for bit, in the SGLang venv
(a subprocess: the main environment has no SGLang); against a float64 attention written here
from the definition; and in every served-log-prob test of the suite (servers run with it).
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap

import torch
from sglang_helpers import SHIM_DIR, load_shim, require_sglang_venv


def _load_shim():
    return load_shim("areal_like_sglang_attention")


def _case(seed: int, heads: int = 4, kv_heads: int = 2, head_dim: int = 32) -> dict:
    """A KV pool, a request-to-token table with scattered slots, and a batch of requests in
    which several share a length (a prompt's samples), some have a cached prefix."""
    gen = torch.Generator().manual_seed(seed)
    pool, n_req, width = 1000, 12, 64
    lengths = [5, 5, 5, 9, 9, 17, 1, 5, 30, 9, 17, 2]
    prefixes = [0, 4, 4, 0, 8, 3, 0, 4, 29, 0, 16, 1]  # extend: new tokens = length - prefix
    slots = torch.randperm(pool, generator=gen)[:n_req * width].view(n_req, width)
    return {
        "k_cache": torch.randn(pool, kv_heads, head_dim, generator=gen),
        "v_cache": torch.randn(pool, kv_heads, head_dim, generator=gen),
        "req_to_token": torch.cat([slots, torch.zeros(4, width, dtype=torch.long)]),
        "req_pool_indices": torch.randperm(n_req, generator=gen),
        "seq_lens": torch.tensor(lengths), "prefixes": torch.tensor(prefixes),
        "decode_q": torch.randn(n_req, heads, head_dim, generator=gen),
        "extend_q": torch.randn(sum(n - p for n, p in zip(lengths, prefixes, strict=True)),
                                heads, head_dim, generator=gen),
        "gqa": heads != kv_heads, "scale": head_dim ** -0.5,
    }


def _attention_float64(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       positions: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v per head, query i seeing keys 0..positions[i]; float64."""
    group = q.shape[1] // keys.shape[1]
    keys = keys.double().repeat_interleave(group, 1)
    values = values.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * scale
    visible = torch.arange(keys.shape[0])[None, :] <= positions[:, None]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


def test_grouped_attention_equals_attention_in_float64():
    shim, c = _load_shim(), _case(0)
    lengths, prefixes = c["seq_lens"].tolist(), c["prefixes"].tolist()
    decode = shim.grouped_sdpa_decode(
        c["decode_q"], torch.empty_like(c["decode_q"]), c["k_cache"], c["v_cache"],
        c["req_to_token"], c["req_pool_indices"], c["seq_lens"], c["scale"], c["gqa"])
    new = c["seq_lens"] - c["prefixes"]
    extend = shim.grouped_sdpa_extend(
        c["extend_q"], torch.empty_like(c["extend_q"]), c["k_cache"], c["v_cache"],
        c["req_to_token"], c["req_pool_indices"], c["seq_lens"], c["prefixes"], new,
        c["scale"], c["gqa"], causal=True)
    start = 0
    for i, (n, p) in enumerate(zip(lengths, prefixes, strict=True)):
        slots = c["req_to_token"][c["req_pool_indices"][i], :n]
        keys, values = c["k_cache"][slots], c["v_cache"][slots]
        want = _attention_float64(c["decode_q"][i:i + 1], keys, values,
                                  torch.tensor([n - 1]), c["scale"])
        torch.testing.assert_close(decode[i:i + 1].double(), want, atol=1e-5, rtol=0)
        rows = slice(start, start + n - p)
        want = _attention_float64(c["extend_q"][rows], keys, values, torch.arange(p, n),
                                  c["scale"])
        torch.testing.assert_close(extend[rows].double(), want, atol=1e-5, rtol=0)
        start += n - p


_AGAINST_SGLANG = textwrap.dedent("""
    import importlib.util, json, sys
    import torch
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
    spec = importlib.util.spec_from_file_location("shim", sys.argv[1])
    shim = importlib.util.module_from_spec(spec); spec.loader.exec_module(shim)
    assert TorchNativeAttnBackend._run_sdpa_forward_decode.__module__ != "shim"  # SGLang's own
    results = []
    for path in sys.argv[2:]:
      c = torch.load(path)
      new = c["seq_lens"] - c["prefixes"]
      args = (c["k_cache"], c["v_cache"], c["req_to_token"], c["req_pool_indices"], c["seq_lens"])
      theirs_d = TorchNativeAttnBackend._run_sdpa_forward_decode(
          None, c["decode_q"], torch.empty_like(c["decode_q"]), *args, None, c["scale"],
          c["gqa"], False, False, None)
      ours_d = shim.grouped_sdpa_decode(c["decode_q"], torch.empty_like(c["decode_q"]), *args,
                                        c["scale"], c["gqa"])
      theirs_e = TorchNativeAttnBackend._run_sdpa_forward_extend(
          None, c["extend_q"], torch.empty_like(c["extend_q"]), *args, c["prefixes"], new, None,
          c["scale"], c["gqa"], True, False, None)
      ours_e = shim.grouped_sdpa_extend(c["extend_q"], torch.empty_like(c["extend_q"]), *args,
                                        c["prefixes"], new, c["scale"], c["gqa"], True)
      results.append({"decode_equal": torch.equal(theirs_d, ours_d),
                      "extend_equal": torch.equal(theirs_e, ours_e),
                      "decode_max": (theirs_d - ours_d).abs().max().item(),
                      "extend_max": (theirs_e - ours_e).abs().max().item()})
    print(json.dumps(results))
""")


def test_grouped_attention_gives_sglang_loops_bits(tmp_path):
    """Each request gets exactly the bits SGLang's per-request loop gives it (batch
    invariance, and so deterministic inference, rests on this)."""
    require_sglang_venv()
    from engines.fleet.launch import resolve_server_python

    cases = []  # grouped-query heads as the tiny models have, and plain multi-head
    for i, shape in enumerate([(4, 2, 32), (8, 8, 16), (16, 2, 64)]):
        cases.append(str(tmp_path / f"case{i}.pt"))
        torch.save(_case(i + 1, *shape), cases[-1])
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_USE_CPU_ENGINE"}  # no hooks
    env["OMP_NUM_THREADS"] = "1"  # as a server runs
    proc = subprocess.run(
        [str(resolve_server_python(".venv-sglang")), "-W", "ignore", "-c", _AGAINST_SGLANG,
         str(SHIM_DIR / "areal_like_sglang_attention.py"), *cases],
        capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == len(cases)
    for result in results:
        assert result["decode_equal"] and result["extend_equal"], results


def test_grouped_attention_leaves_other_cases_to_sglang():
    shim = _load_shim()
    assert shim._plain(None, False, None) and shim._plain(None, False, -1)
    assert not shim._plain(torch.tensor([3]), False, None)  # encoder lengths
    assert not shim._plain(None, True, None)  # cross-attention
    assert not shim._plain(None, False, 128)  # a sliding window
