"""LoRA: adapter-only training on the FSDP2 engine (one rank in process, two under torchrun),
adapter-only sync to real SGLang servers checked against HF + PEFT float64 after each update,
a restarted server that must load the current adapter before it serves, and a GRPO run."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lora_worker as W
import pytest
import torch
from conftest import SGLANG_TEST_API_KEY
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from tensordict import TensorDict
from torchrun_helpers import LAUNCH_TIMEOUT_S, run_worker
from transformers import AutoModelForCausalLM

from areal_like.api import GenerationHyperparameters, ModelRequest, SaveLoadMeta
from areal_like.api.config import (
    ModelConfig,
    OptimizerConfig,
    ServerConfig,
    TrainEngineConfig,
)
from areal_like.api.io_struct import AdapterWeights
from areal_like.api.lora_config import DECODER_LINEAR_MODULES, LoRAConfig
from areal_like.runtime.weight_sync import push_weights
from engines import FSDPEngine

# servers and torchrun jobs of its own only (no session fleet): beside the serial lane
pytestmark = [pytest.mark.beside_serial]

PROMPTS = [[5, 17, 33, 60], [70, 81, 99, 120, 7], [11, 12], [200, 3, 44]]


def _peft_reference(model_dir: Path, adapter: AdapterWeights | None,
                    lora: LoRAConfig) -> torch.nn.Module:
    """float64 HF base (+ the adapter through PEFT, when given): the independent reference."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager").double()
    if adapter is None:
        return model.eval()
    peft = get_peft_model(model, LoraConfig(r=lora.rank, lora_alpha=lora.alpha,
                                            target_modules=list(lora.target_modules)))
    result = set_peft_model_state_dict(peft, {k: v.double() for k, v in adapter.tensors.items()})
    assert not result.unexpected_keys
    return peft.eval()


def _logprobs(model: torch.nn.Module, prompt: list[int], output: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logp = model(input_ids=ids).logits[0, len(prompt) - 1:-1].double().log_softmax(-1)
    return logp.gather(-1, torch.tensor(output)[:, None])[:, 0]


def _batch(seed: int, vocab: int = 500) -> TensorDict:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (4, 10), generator=gen)
    return TensorDict({"input_ids": ids, "attention_mask": torch.ones_like(ids),
                       "loss_mask": torch.ones_like(ids)}, batch_size=[4])


def _lora_engine(model_dir: Path, lora: LoRAConfig, lr: float = 5e-2) -> FSDPEngine:
    engine = FSDPEngine(TrainEngineConfig(model=ModelConfig(path=str(model_dir)),
                                          optimizer=OptimizerConfig(lr=lr), lora=lora))
    engine.initialize()
    return engine


# ---- one rank, in process -------------------------------------------------------------------
def test_one_rank_trains_only_the_adapter_and_serves_base_and_merged(tiny_model_dir, tmp_path):
    lora = LoRAConfig(rank=4, alpha=8)
    engine = _lora_engine(tiny_model_dir, lora)
    try:
        trainable = [n for n, p in engine.model.named_parameters() if p.requires_grad]
        assert len(trainable) == 2 * len(DECODER_LINEAR_MODULES) * 4  # A, B x 7 modules x 4
        assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
        frozen_before = {n: p.detach().clone() for n, p in engine.model.named_parameters()
                         if not p.requires_grad}
        for seed in (1, 2):
            stats = engine.train_batch(_batch(seed), W.token_nll, lambda mb: W._mask(mb).sum())
            assert stats["update_successful"] == 1.0
        frozen_after = dict(engine.model.named_parameters())
        assert all(torch.equal(frozen_before[n], frozen_after[n]) for n in frozen_before)
        adapter = engine.adapter_weights()
        assert adapter is not None and adapter.config["r"] == 4
        assert any(t.abs().max() > 0 for k, t in adapter.tensors.items() if "lora_B" in k)

        batch = _batch(3)
        prompt, output = batch["input_ids"][0, :4].tolist(), batch["input_ids"][0, 4:].tolist()
        policy = engine.forward(batch)[0, 3:-1].double()  # log p of tokens 4.. of row 0
        base = engine.base_model_view().forward(batch)[0, 3:-1].double()
        ref_policy = _logprobs(_peft_reference(tiny_model_dir, adapter, lora), prompt, output)
        ref_base = _logprobs(_peft_reference(tiny_model_dir, None, lora), prompt, output)
        assert (policy - ref_policy).abs().max() < 1e-5  # float32 engine vs float64 reference
        assert (base - ref_base).abs().max() < 1e-5  # the KL reference: adapters off
        assert (ref_policy - ref_base).abs().max() > 1e-2  # ... and the adapter matters

        engine.save(SaveLoadMeta(str(tmp_path / "hf"), weight_format="hf"))  # merged
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float64)
        assert (_logprobs(merged.eval(), prompt, output) - ref_policy).abs().max() < 1e-5
        with pytest.raises(ValueError, match="LoRA engine"):
            engine.load(SaveLoadMeta(str(tmp_path / "hf"), weight_format="hf"))
        with pytest.raises(ValueError, match="adapter_weights"):
            engine.weight_specs()
    finally:
        engine.destroy()


def test_bad_lora_settings_are_named(tiny_model_dir):
    with pytest.raises(ValueError, match=r"target_modules names \['qkv'\]"):
        _lora_engine(tiny_model_dir, LoRAConfig(rank=4, target_modules=["q_proj", "qkv"]))
    critic = TrainEngineConfig(model=ModelConfig(path=str(tiny_model_dir), is_critic=True),
                               lora=LoRAConfig(rank=4))
    with pytest.raises(ValueError, match="on a critic"):
        FSDPEngine(critic).initialize()
    with pytest.raises(ValueError, match="LoRAConfig.rank"):
        LoRAConfig(rank=-1)
    with pytest.raises(ValueError, match="LoRAConfig.target_modules"):
        LoRAConfig(rank=8, target_modules=[])
    from recipes.configs import GRPOConfig
    with pytest.raises(ValueError, match="vLLM fleet"):
        GRPOConfig(actor=TrainEngineConfig(lora=LoRAConfig(rank=8)),
                   server=ServerConfig(backend="vllm"))


def test_the_shipped_lora_recipe_serves_what_it_trains():
    from areal_like.api.config_loader import load_config
    from recipes.configs import GRPOConfig

    config = load_config(GRPOConfig, Path("recipes/conf/grpo_addition_lora.yaml").resolve(),
                         ["model.path=/m"])
    assert config.actor.lora.rank == 16 and config.total_train_steps == 200  # the main job's
    assert config.server.lora_rank == 16  # the launcher starts servers with LoRA serving
    assert config.server.lora_target_modules == list(DECODER_LINEAR_MODULES)
    assert config.rollout.lora_adapter == "policy"  # and every request names the adapter


# ---- two ranks, torchrun ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_rank_run(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> dict[str, Any]:
    return run_worker("lora_worker.py", tiny_model_dir, tmp_path_factory.mktemp("lora_worker"))


def _reference_adapters(model_dir: Path, initial: dict[str, torch.Tensor],
                        batches: list[TensorDict]) -> list[dict[str, torch.Tensor]]:
    """Plain float64 PEFT training from the same initial adapter: global token-mean NLL over
    the whole batch, clipped to norm 1.0, AdamW (the worker's lr and eps)."""
    peft = _peft_reference(model_dir, AdapterWeights({}, initial), W.LORA)
    params = [p for p in peft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=W.LR, eps=1e-3, weight_decay=0.0)
    out = []
    for batch in batches:
        ids, attn = batch["input_ids"], batch["attention_mask"]
        logp = peft(input_ids=ids, attention_mask=attn).logits[:, :-1].log_softmax(-1)
        token_logp = logp.gather(-1, ids[:, 1:, None])[..., 0]
        mask = (attn[:, 1:] * batch["loss_mask"][:, 1:]).bool()
        loss = -(token_logp * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        out.append({k: v.detach().clone() for k, v in get_peft_model_state_dict(peft).items()})
    return out


@pytest.mark.torchrun
@pytest.mark.e2e
def test_two_ranks_train_the_adapter_like_one_float64_process_and_resume_exactly(
        two_rank_run, tiny_model_dir):
    run = two_rank_run
    assert run["world_size"] == 2
    # the base never moves
    for name, before in run["base_before"].items():
        if ".lora_" not in name:
            assert torch.equal(before, run["base_after"][name]), name
    initial, *trained = run["adapters"]
    assert all(not t.any() for k, t in initial.items() if "lora_B" in k)  # B = 0 at first
    batches = W.batches(int(AutoModelForCausalLM.from_pretrained(tiny_model_dir)
                            .config.vocab_size))
    reference = _reference_adapters(tiny_model_dir, initial, batches[:2])
    for got, want in zip(trained, reference, strict=True):
        assert got.keys() == want.keys()
        assert max(float((got[k].double() - want[k]).abs().max()) for k in got) < 1e-5
    # exact resume: adapter and optimizer state come back from the DCP checkpoint
    assert run["resumed_version"] == 2
    assert all(torch.equal(run["continued"][k], run["resumed"][k]) for k in run["continued"])


# ---- real SGLang servers serving base + adapter ------------------------------------------------
@pytest.fixture(scope="module")
def lora_fleet(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Two SGLang servers started with LoRA serving (rank <= 8, the decoder's linear layers)."""
    from sglang_helpers import require_sglang_venv

    from engines.fleet.launch import InferenceFleet

    require_sglang_venv()
    config = ServerConfig(n_servers=2, max_total_tokens=8192, lora_rank=8,
                          lora_target_modules=list(DECODER_LINEAR_MODULES),
                          fork_children=True)  # ~13 s less per start, the restart too
    with InferenceFleet(tiny_model_dir, config, api_key=SGLANG_TEST_API_KEY,
                        log_dir=tmp_path_factory.mktemp("lora_logs")) as fleet:
        yield fleet


def _generate(client: Any, version: int, every_server: bool = True) -> list[Any]:
    """Sampled requests at once (least-inflight spreads them: each server answers one)."""
    g = GenerationHyperparameters(max_new_tokens=6, temperature=1.0)

    async def run() -> list[Any]:
        return await asyncio.gather(*(client.agenerate(ModelRequest(input_ids=p, gconfig=g))
                                      for p in PROMPTS))

    replies = asyncio.run(run())
    if every_server:
        assert {r.metadata["server"] for r in replies} == set(client.addresses)
    assert all(set(r.output_versions) == {version} for r in replies)
    return replies


def _max_error(replies: list[Any], reference: torch.nn.Module) -> float:
    return max(float((torch.tensor(r.output_logprobs, dtype=torch.float64)
                      - _logprobs(reference, r.input_tokens, r.output_tokens)).abs().max())
               for r in replies)


@pytest.mark.sglang
@pytest.mark.e2e
def test_each_update_delivers_the_trainers_current_adapter(lora_fleet, tiny_model_dir, tmp_path):
    """After every update, from disk and in memory alternately, both servers' log-probs are
    those of HF float64 base + the trainer's current adapter, not the previous adapter's."""
    from sglang_helpers import make_engine

    lora = LoRAConfig(rank=8, alpha=16)
    engine = _lora_engine(tiny_model_dir, lora)
    client = make_engine(lora_fleet.addresses, SGLANG_TEST_API_KEY, lora_adapter="policy")
    try:
        previous = None
        for version, in_memory in [(0, False), (1, True), (2, False), (3, True)]:
            if version:
                engine.train_batch(_batch(version), W.token_nll, lambda mb: W._mask(mb).sum())
            push_weights(engine, client, version, tmp_path / "weights", in_memory=in_memory)
            adapter = engine.adapter_weights()
            replies = _generate(client, version)
            current = _peft_reference(tiny_model_dir, adapter, lora)
            assert _max_error(replies, current) < 1e-4, (version, in_memory)
            if previous is not None:
                assert _max_error(replies, previous) > 1e-2, (version, "still the old adapter")
            previous = current
        # scoring given tokens names the adapter too
        r = replies[0]
        scored = asyncio.run(client.ascore_batch([r.input_tokens + r.output_tokens],
                                                 [len(r.input_tokens)]))[0]
        want = _logprobs(current, r.input_tokens, r.output_tokens)
        assert float((torch.tensor(scored, dtype=torch.float64) - want).abs().max()) < 1e-4
        assert sorted(os.listdir(tmp_path / "weights" / "v2")) == [
            "adapter_config.json", "adapter_model.safetensors"]  # the adapter only
    finally:
        client.destroy()
        engine.destroy()


@pytest.mark.sglang
@pytest.mark.e2e
def test_restarted_server_loads_the_current_adapter_before_it_serves(lora_fleet, tiny_model_dir,
                                                                     tmp_path):
    """A server restarted between requests comes back with the base only: the first request
    it refuses (no adapter) takes it out, the current adapter is loaded, and only then does
    it serve again: with that adapter's log-probs and version."""
    from sglang_helpers import make_engine

    from engines.sglang.lora_api import SGLangLoRAAPI

    lora = LoRAConfig(rank=8, alpha=16)
    engine = _lora_engine(tiny_model_dir, lora)
    client = make_engine(lora_fleet.addresses, SGLANG_TEST_API_KEY, lora_adapter="policy",
                         retry_backoff=0.1, health_check_interval=0.5)
    victim = lora_fleet.addresses[1]
    try:
        engine.train_batch(_batch(11), W.token_nll, lambda mb: W._mask(mb).sum())
        push_weights(engine, client, 5, tmp_path / "weights", in_memory=True)
        current = _peft_reference(tiny_model_dir, engine.adapter_weights(), lora)
        lora_fleet.kill_server(1)
        lora_fleet.processes[1].wait(timeout=60)
        lora_fleet.restart_server(1)  # base weights, no adapter, version label 0
        api = SGLangLoRAAPI("policy")

        async def adapters() -> list[str]:
            import aiohttp
            async with aiohttp.ClientSession(headers={
                    "Authorization": f"Bearer {SGLANG_TEST_API_KEY}"}) as session:
                return await api.loaded_adapters(session, victim)

        lora_fleet.wait_healthy(300)
        assert asyncio.run(adapters()) == []  # restarted: nothing loaded
        assert victim in client.in_service()  # nothing has told the client yet
        # the victim refuses (no adapter): out of service, its requests served by the other
        replies = _generate(client, 5, every_server=False)
        deadline = time.monotonic() + 300
        while victim not in client.in_service():  # readmitted once it loaded the adapter
            assert time.monotonic() < deadline, "the restarted server was never readmitted"
            time.sleep(0.1)
        assert asyncio.run(adapters()) == ["policy"]
        replies += _generate(client, 5)
        assert _max_error(replies, current) < 1e-4
        stats = client.fleet_stats()
        assert stats["fleet/taken_out_total"] >= 1 and stats["fleet/readmitted_total"] >= 1
    finally:
        client.destroy()
        engine.destroy()


@pytest.mark.sglang
@pytest.mark.e2e
def test_grpo_with_lora_on_the_fleet_serves_every_version_exactly(lora_fleet, tiny_model_dir,
                                                                 tmp_path):
    """A GRPO run with LoRA through the launcher, attached to the LoRA fleet: adapters sent in
    memory, the KL reference is the actor's own base. On-policy (eta = 0), so the rollouts'
    log-probs must equal the trainer's recomputed ones at every step: the fleet served each
    step's adapter, not the previous one or the base."""
    from sglang_helpers import attach_args, fleet_version

    from areal_like.utils.metrics_logger import read_metrics

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent),
                                          os.environ.get("PYTHONPATH", "")])}
    args = ["grpo", f"model.path={tiny_model_dir}", f"logging.log_dir={tmp_path}",
            "total_train_steps=3", "gconfig.n_samples=4", "gconfig.max_new_tokens=4",
            "rollout.staleness.consumer_batch_size=4", "train_dataset.batch_size=4",
            "train_dataset.size=64", "valid_dataset.size=8", "evaluation.n_prompts=8",
            "evaluation.freq_steps=100", "logging.tensorboard=false", "logging.plot=false",
            "rollout.staleness.max_head_offpolicyness=0", "rollout.weights.transport=distributed",
            "actor.lora.rank=8", "actor.lora.alpha=16", "actor.optimizer.lr=5e-3",
            "use_ref_model=true", "algorithm.kl.coef=0.01", "reward.fn=reward_fns:even_length",
            *attach_args(lora_fleet)]
    proc = subprocess.run([sys.executable, "-m", "areal_like.launcher.local", *args], env=env,
                          cwd=Path(__file__).parents[1], capture_output=True, text=True,
                          timeout=LAUNCH_TIMEOUT_S)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    records = [r for r in read_metrics(tmp_path / "grpo_addition" / "trial0" / "metrics.jsonl")
               if "actor/gap/abs_log_diff/max" in r]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert r["actor/gap/abs_log_diff/max"] < 1e-4, r  # served = trained, token by token
        assert r["grad_norm"] > 0.0, r  # the adapter moves at every step
    # the KL reference is the base (adapters off): 0 before the first update, then not
    assert records[0]["actor/kl_ref/max"] == 0.0 and records[-1]["actor/kl_ref/max"] > 0.0
    assert fleet_version(lora_fleet.addresses, SGLANG_TEST_API_KEY) == 3
    final = tmp_path / "grpo_addition" / "trial0" / "final"
    assert (final / "config.json").exists() and (final / "model.safetensors").exists()
