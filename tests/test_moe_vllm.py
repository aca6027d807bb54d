"""A mixture of experts (tiny Qwen3-MoE) served by one real vLLM server on CPU: its log-probs
equal a float64 transformers forward of the same weights, before and after a disk load and a
process-group broadcast from the FSDP2 trainer (vLLM 0.32's CPU experts must be laid out again
after a reload: engines/vllm/worker). Routed experts are SGLang's only here: asking a vLLM
fleet for them is refused at start."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import SGLANG_TEST_API_KEY, VLLM_TEST_ARGS, require_venv
from sglang_helpers import fleet_version, make_engine
from test_moe_sglang import assert_served, generate
from test_weight_broadcast import _export, _perturb, _Rank0Broadcaster

from areal_like.api import WeightUpdateMeta
from areal_like.api.config import ModelConfig, OptimizerConfig, ServerConfig, TrainEngineConfig
from engines import FSDPEngine
from engines.fleet.launch import InferenceFleet

# servers and torchrun jobs of its own only (no session fleet): beside the serial lane
pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.beside_serial]


@pytest.fixture(scope="module")
def moe_vllm(tiny_moe_dir: Path, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[InferenceFleet]:
    require_venv("vllm")
    config = ServerConfig(backend="vllm", n_servers=1, context_length=1024,
                          extra_args=list(VLLM_TEST_ARGS))
    with InferenceFleet(tiny_moe_dir, config, api_key=SGLANG_TEST_API_KEY,
                        log_dir=tmp_path_factory.mktemp("moe_vllm_logs")) as fleet:
        yield fleet


def test_vllm_serves_the_experts_it_starts_with_loads_and_receives(moe_vllm, tiny_moe_dir,
                                                                  tmp_path):
    trainer = FSDPEngine(TrainEngineConfig(model=ModelConfig(path=str(tiny_moe_dir)),
                                           optimizer=OptimizerConfig(lr=1e-3)))
    trainer.initialize()
    client = make_engine(moe_vllm.addresses, SGLANG_TEST_API_KEY, backend="vllm",
                         weight_transport="distributed", weight_bucket_mb=0.25)
    client.set_version(fleet_version(moe_vllm.addresses, SGLANG_TEST_API_KEY, "vllm"))
    broadcaster = _Rank0Broadcaster(client)
    try:
        assert_served(generate(client, greedy=True), tiny_moe_dir, routing=False)
        _perturb(trainer, seed=3)
        disk = _export(trainer, tmp_path / "disk")
        client.update_weights(WeightUpdateMeta.from_disk(str(disk), client.get_version() + 1))
        assert_served(generate(client, greedy=False), disk, routing=False)
        _perturb(trainer, seed=4)
        broadcaster.push_to_fleet(trainer, client.get_version() + 1)
        assert_served(generate(client, greedy=False), _export(trainer, tmp_path / "pg"),
                      routing=False)
    finally:
        broadcaster.updater.close()
        broadcaster.close()
        client.destroy()
        trainer.destroy()
    with pytest.raises(ValueError, match="return_routed_experts with a vllm fleet"):
        make_engine(moe_vllm.addresses, SGLANG_TEST_API_KEY, backend="vllm",
                    return_routed_experts=True)
