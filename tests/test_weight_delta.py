"""The delta transport (`rollout.weights.transport=delta`): weight files of what changed
(engines/weight_transport/delta/), applied by real servers, bit-identical to full loads."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from conftest import SGLANG_TEST_API_KEY
from sglang_helpers import fleet_version, make_engine, restore_session_fleet
from test_weight_broadcast import _assert_serves, _export, _RecordedClient

from areal_like.api.config import ModelConfig, OptimizerConfig, TrainEngineConfig
from areal_like.api.io_struct import WeightUpdateMeta
from areal_like.runtime.weight_delta import WeightDeltaPusher
from engines import FSDPEngine
from engines.fleet.updater import FleetUpdater
from engines.weight_transport.delta import RECEIVER_DIR
from engines.weight_transport.delta_trainer import DeltaSender

sys.path.insert(0, str(RECEIVER_DIR))
import areal_like_weight_delta as wd  # noqa: E402 - the servers' own import of it

CHANGED = 3  # of the tiny model's tensors, every CHANGED-th one moves in an update


def _weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"embed": torch.randn(64, 16, generator=gen),
            "norm": torch.randn(16, generator=gen).to(torch.bfloat16),
            "proj": torch.randn(16, 32, generator=gen).to(torch.float64),
            "empty": torch.empty(0, 4)}


def _step(weights: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A small optimizer-like step: a few elements of `embed` and `norm` move, `proj` not."""
    gen = torch.Generator().manual_seed(seed)
    new = {k: v.clone() for k, v in weights.items()}
    rows = torch.randint(0, 64, (5,), generator=gen)
    new["embed"][rows] += 1e-3 * torch.randn(5, 16, generator=gen)
    new["norm"][:4] += torch.tensor(0.25, dtype=torch.bfloat16)
    return new


def _send(sender: DeltaSender, version: int, weights: dict[str, torch.Tensor]) -> str:
    path, _, _ = sender.begin(version)
    sender.add(list(weights), list(weights.values()))
    sender.finish(version)
    return str(path)


@pytest.mark.parametrize("codec", wd.CODECS)
def test_a_delta_applied_to_its_base_gives_the_new_bytes_and_every_bad_file_is_refused(
        tmp_path: Path, codec: str) -> None:
    v0, v1 = _weights(0), None
    sender = DeltaSender(tmp_path, codec=codec)
    server = wd.HeldWeights()
    loads: list[list[str]] = []

    def load(changed: list, state: dict) -> None:
        loads.append([name for name, _ in changed])

    full = _send(sender, 0, v0)
    assert server.apply_file(full, load)["applied"] and loads[-1] == list(v0)
    v1 = _step(v0, 1)
    delta = _send(sender, 1, v1)
    receipt = server.apply_file(delta, load)
    assert receipt["applied"] and receipt["kind"] == "delta", receipt
    assert loads[-1] == ["embed", "norm"]  # `proj` did not change: not sent, not loaded
    for name, tensor in v1.items():  # bit for bit, whatever the dtype
        assert server.tensors[name].dtype == tensor.dtype
        assert torch.equal(server.tensors[name].view(torch.uint8), tensor.view(torch.uint8))
    assert receipt["state_digest"] == sender.state_digest
    assert Path(delta).stat().st_size < Path(full).stat().st_size / 4

    # a delta against a base the server does not hold: refused, nothing loaded
    v2 = _step(v1, 2)
    stale = wd.HeldWeights()
    stale.apply_file(full, load)
    before = len(loads)
    delta2 = _send(sender, 2, v2)
    assert stale.apply_file(delta2, load)["refused"] == "base"
    # a corrupted payload byte, or a corrupted footer: refused by checksum
    data = bytearray(Path(delta2).read_bytes())
    for where in (len(wd.MAGIC) + 1, len(data) - wd.TRAILER.size - 5):
        bad = bytearray(data)
        bad[where] ^= 0x40
        (tmp_path / "bad").write_bytes(bytes(bad))
        assert server.apply_file(str(tmp_path / "bad"), load)["refused"] == "corrupt"
    assert server.apply_file(str(tmp_path / "missing"), load)["refused"] == "unreadable"
    # another model's full file
    other = DeltaSender(tmp_path / "other")
    other_full = _send(other, 0, {"embed": v0["embed"], "lm_head": v0["proj"]})
    assert server.apply_file(other_full, load)["refused"] == "model"
    # the model it loaded into changed since (loaded another way): no base for a delta
    moved = server.fingerprint + "-moved"
    assert server.apply_file(delta2, load, fingerprint=lambda: moved)["refused"] == "base"
    assert len(loads) == before and server.version == 1  # every refusal left it untouched
    assert server.apply_file(delta2, load)["applied"]
    # a full file on demand, of the version the trainer holds
    assert wd.HeldWeights().apply_file(sender.full_file(2), load)["state_digest"] == \
        sender.state_digest


def test_a_load_that_fails_halfway_is_reported_and_forgets_its_base(tmp_path: Path) -> None:
    sender = DeltaSender(tmp_path)
    server = wd.HeldWeights()
    server.apply_file(_send(sender, 0, _weights(0)), lambda c, s: None)

    def broken(changed: list, state: dict) -> None:
        raise RuntimeError("out of memory")

    receipt = server.apply_file(_send(sender, 1, _step(_weights(0), 1)), broken)
    assert receipt["refused"] == "load" and receipt["partial"] and "out of memory" in \
        receipt["error"]
    assert server.version is None  # its next update is a full one
    # loaded, but what checks it afterwards fails: reported the same way, never raised
    server.apply_file(sender.full_file(1), lambda c, s: None)

    def failing_fingerprint() -> str:
        raise RuntimeError("device lost")

    receipt = server.apply_file(sender.full_file(1), lambda c, s: None,
                                fingerprint=failing_fingerprint)
    assert receipt["partial"] and "device lost" in receipt["error"] and server.version is None


def test_the_trainer_names_its_files_by_absolute_paths(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Servers run in other working directories: a relative log dir still gives them
    absolute paths (the delta's and the full file's)."""
    monkeypatch.chdir(tmp_path)
    sender = DeltaSender(Path("runs") / "delta")
    path = _send(sender, 0, _weights(0))
    assert Path(path).is_absolute() and Path(sender.full_file(0)).is_absolute()


# ---- real servers ----------------------------------------------------------------------------
@pytest.fixture
def trainer(tiny_model_dir: Path):
    engine = FSDPEngine(TrainEngineConfig(model=ModelConfig(path=str(tiny_model_dir)),
                                          optimizer=OptimizerConfig(lr=1e-3)))
    engine.initialize()
    yield engine
    engine.destroy()


def _small_step(engine: FSDPEngine, seed: int) -> None:
    """Every CHANGED-th tensor moves a little (the others stay: their bytes are not sent)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for i, p in enumerate(engine.model.parameters()):
            if i % CHANGED == 0:
                local = p.to_local() if hasattr(p, "to_local") else p
                local.add_(1e-3 * torch.randn(local.shape, generator=gen).to(local.device))


@pytest.mark.e2e
def test_servers_apply_deltas_bit_identical_to_full_loads_and_fall_back_when_they_must(
        trainer, any_fleet, tiny_model_dir, tmp_path):
    fleet = any_fleet
    backend = fleet.config.backend
    client = make_engine(fleet.addresses, SGLANG_TEST_API_KEY, backend=backend,
                         weight_transport="delta", weight_update_timeout=60.0,
                         retry_backoff=0.1, health_check_interval=0.5)
    client.config.weights.delta_model_digest = True
    client.set_version(fleet_version(fleet.addresses, SGLANG_TEST_API_KEY, backend))
    told = _RecordedClient(client)
    updater = FleetUpdater(client.config, told)
    pusher = WeightDeltaPusher(client.config, tmp_path / "delta")
    loader = updater.delta_loader
    try:
        start = client.get_version()
        stats = pusher.push(trainer, updater, start + 1)  # no base anywhere yet: full
        assert loader.counts == {"full": 2, "delta": 0}, loader.counts
        assert stats["weight_sync/file_ratio"] < 1.0  # compressed
        for version in (start + 2, start + 3):
            _small_step(trainer, seed=version)
            stats = pusher.push(trainer, updater, version)
            assert stats["weight_sync/changed_tensors"] > 0
            assert stats["weight_sync/file_ratio"] < 0.5, stats  # a third of the tensors moved
            assert not client.servers.out_of_service, client.servers.out_of_service
            assert fleet_version(fleet.addresses, SGLANG_TEST_API_KEY, backend) == version
        assert loader.counts == {"full": 2, "delta": 4}, loader.counts
        weights = _export(trainer, tmp_path / f"v{version}")
        _assert_serves(client, weights, version, set(fleet.addresses))  # log-prob parity

        # bit-identical: the version the servers built from deltas, against the same version
        # loaded whole (a digest of each server's own parameters, in its own layout)
        first, second = fleet.addresses
        from_deltas = {a: loader.receipts[a]["model_digest"] for a in fleet.addresses}
        assert from_deltas[first] == from_deltas[second]
        assert _apply_directly(updater, first, pusher.sender.full_file(version), version) == \
            from_deltas[first]
        # a server whose weights were loaded another way since (the client still thinks it
        # holds the base) refuses the delta for its base and loads the full version instead
        _load_folder_directly(updater, first, tiny_model_dir, version)
        corrupt_next = {"on": False}
        finish = pusher.sender.finish

        def finish_then_corrupt(v: int):  # the second push's delta reaches servers corrupted
            stats = finish(v)
            if corrupt_next["on"]:
                path = pusher.sender.directory / f"v{v}.delta"
                data = bytearray(path.read_bytes())
                data[len(wd.MAGIC) + 3] ^= 0x11
                path.write_bytes(bytes(data))
            return stats

        pusher.sender.finish = finish_then_corrupt  # type: ignore[method-assign]
        _small_step(trainer, seed=50)
        pusher.push(trainer, updater, version + 1)
        assert loader.counts["fallbacks_base"] == 1 and loader.counts["delta"] == 5
        corrupt_next["on"] = True
        _small_step(trainer, seed=51)
        pusher.push(trainer, updater, version + 2)
        assert loader.counts["fallbacks_corrupt"] == 2 and loader.counts["full"] == 5
        assert not client.servers.out_of_service
        _assert_serves(client, _export(trainer, tmp_path / "last"), version + 2,
                       set(fleet.addresses))
        assert told.calls == ["begin_weight_update", "end_weight_update"] * 5
    finally:
        updater.close()
        client.destroy()
        restore_session_fleet(fleet, tiny_model_dir)


def _apply_directly(updater: FleetUpdater, addr: str, path: str, version: int) -> str:
    """Apply a weight file on one server (the fleet client is not told); its model digest."""
    api = updater.api

    async def apply() -> dict:
        session = updater._require_session()
        await api.pause(session, addr, api.update_pause_mode)
        await api.begin_update(session, addr)
        try:
            return await api.apply_weight_file(session, addr, path, version, 60.0,
                                               model_digest=True)
        finally:
            await api.end_update(session, addr)
            await api.resume(session, addr)

    receipt = updater._run(apply(), 120.0)
    assert receipt["applied"], receipt
    return str(receipt["model_digest"])


def _load_folder_directly(updater: FleetUpdater, addr: str, folder: Path, version: int) -> None:
    """A folder loaded on one server the disk transport's way (the client is not told)."""
    from engines.fleet.updates import update_one

    meta = WeightUpdateMeta.from_disk(str(folder), version)
    updater._run(update_one(updater._require_session(), updater.api, addr, meta, 60.0), 120.0)
