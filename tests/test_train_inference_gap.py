"""The train/inference gap on real SGLang servers: healthy when the servers serve the trainer's
weights, jumping when one serves other weights under the same version label, and the
configured correction bounding what those tokens do to the update."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path

import pytest
from conftest import SGLANG_TEST_API_KEY
from sglang_helpers import fleet_version, make_engine, perturbed_copy, restore_session_fleet
from test_algo_ref_engine import RefEngine, _model

from areal_like.algorithms import PPOActor
from areal_like.api.algorithm_presets import algorithm_preset
from areal_like.api.io_struct import GenerationHyperparameters, ModelRequest
from areal_like.utils.batching import concat_padded
from areal_like.utils.stats_tracker import StatsTracker
from workflows.common import TrajectoryBuilder

pytestmark = pytest.mark.sglang

PROMPTS = [[11, 22, 33, 44, 55], [7, 8, 9], [101, 5, 17, 3], [40, 41]]


async def _batch_from(engine):
    """4 prompts x 4 samples from the fleet (both servers), rewards 1 for even lengths."""
    g = GenerationHyperparameters(max_new_tokens=12, temperature=1.0, n_samples=4)
    groups = await asyncio.gather(*(engine.agenerate_n(ModelRequest(input_ids=p, gconfig=g))
                                    for p in PROMPTS))
    rows, servers = [], []
    for group_id, (prompt, responses) in enumerate(zip(PROMPTS, groups, strict=True)):
        for resp in responses:
            builder = TrajectoryBuilder(prompt)
            builder.add_generation(resp)
            rows.append(builder.to_tensordict(float(resp.output_len % 2 == 0),
                                              group_id=group_id))
            servers.append(resp.metadata["server"])
    return concat_padded(rows), servers


def _gap(batch, trainer_dir: Path, version: int) -> dict[str, float]:
    """What the trainer logs for `batch`: the gap before the update, the loss's weights."""
    tracker = StatsTracker()
    engine = RefEngine(_model(trainer_dir), lr=0.0, max_tokens_per_mb=64)
    engine.set_version(version)
    config = algorithm_preset("grpo", group_size=4, off_policy={"correction": "mis_token"})
    PPOActor(engine, config, tracker=tracker).update(batch)
    return tracker.export()


def _load_on(addr: str, model_dir: Path, version: int) -> None:
    """`model_dir` on one server, labelled `version` (what a faulty update would leave)."""
    body = json.dumps({"model_path": str(model_dir), "weight_version": str(version)})
    req = urllib.request.Request(f"http://{addr}/update_weights_from_disk", body.encode(),
                                 {"Authorization": f"Bearer {SGLANG_TEST_API_KEY}",
                                  "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        assert json.load(resp).get("success")


async def test_the_gap_catches_a_server_serving_other_weights(sglang_fleet, tiny_model_dir,
                                                              tmp_path):
    version = fleet_version(sglang_fleet.addresses, SGLANG_TEST_API_KEY)
    engine = make_engine(sglang_fleet.addresses, SGLANG_TEST_API_KEY)
    engine.set_version(version)
    try:
        batch, _ = await _batch_from(engine)
        healthy = _gap(batch, tiny_model_dir, version)
        faulty_server = sglang_fleet.addresses[0]
        _load_on(faulty_server, perturbed_copy(tiny_model_dir, tmp_path / "other", seed=3,
                                               scale=0.1), version)
        batch, servers = await _batch_from(engine)
        assert faulty_server in servers and len(set(servers)) == 2
        faulty = _gap(batch, tiny_model_dir, version)
    finally:
        engine.destroy()
        restore_session_fleet(sglang_fleet, tiny_model_dir)

    # healthy: the fp32 server and trainer agree to rounding; no correction drops a token
    assert healthy["actor/gap/abs_log_diff/max"] < 1e-3
    assert healthy["actor/gap/lag0/abs_log_diff/max"] < 1e-3
    for name in ("mis_token", "mis_seq", "icepop"):
        assert healthy[f"actor/gap/{name}_masked/avg"] == 0.0
    # the fault: every token is lag 0 (same label), yet the gap jumps by orders of magnitude
    assert faulty["actor/gap/lag0/abs_log_diff/avg"] > 100 * healthy[
        "actor/gap/lag0/abs_log_diff/avg"]
    assert faulty["actor/gap/abs_log_diff/max"] > 0.5
    assert faulty["actor/gap/k3/avg"] > 100 * max(healthy["actor/gap/k3/avg"], 1e-9)
    assert faulty["actor/gap/mis_token_masked/avg"] > 0
    # the correction bounds what those tokens weigh in the update: every kept weight is
    # inside mis_token's [0.5, 2], though the raw weights are not
    assert faulty["actor/gap/imp_weight/max"] > 2.0 or faulty["actor/gap/imp_weight/min"] < 0.5
    assert faulty["actor/update/behav_imp_weight/min"] >= 0.5
    assert faulty["actor/update/behav_imp_weight/max"] <= 2.0
