"""The distributed weight transport against real SGLang servers on CPU (gloo): the trainer (an
in-process FSDPEngine) broadcasts its weights bucket by bucket over a process group the
servers joined. Checked: the servers then compute with exactly the trainer's weights (log-probs
against a float64 reference of the trainer's exported weights), report the new version, a
request in flight carries both versions, both servers get every update, and a server killed
before or during a broadcast ends the update within its timeout with an error naming it —
then the run goes on with the survivor (`retry`) or stops (`stop`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import SGLANG_TEST_API_KEY
from sglang_helpers import (
    LOGPROB_ATOL,
    WINDOW_ATTEMPTS,
    assert_same_records,
    eos_token_id,
    fleet_version,
    hf_logprobs,
    make_engine,
    reset_fleet,
    restore_session_fleet,
)

from areal_like.api.config import ModelConfig, OptimizerConfig, TrainEngineConfig
from areal_like.api.io_struct import (
    GenerationHyperparameters,
    ModelRequest,
    SaveLoadMeta,
)
from areal_like.runtime.weight_broadcast import WeightBroadcaster, WeightBroadcastFailed
from engines import FSDPEngine
from engines.fleet.client import RemoteInferenceEngine, RemoteSGLangEngine
from engines.fleet.launch import InferenceFleet
from engines.fleet.updater import FleetUpdater

pytestmark = [pytest.mark.e2e]
PROMPT = [11, 22, 33, 44, 55]
TIMEOUT_S = 60.0  # rollout.weights.update_timeout of these tests: a failure ends well inside it
# rollout.weights.broadcast_timeout of the tests that kill a server: a peer killed mid-broadcast
# is noticed by gloo only when this runs out (gloo's sender waits for the dead receiver's notice
# until its timeout). The others keep the default (120 s): a busy machine may starve a server
# past 15 s, and there this bound is for a hang only.
BROADCAST_TIMEOUT_S = 15.0
BUCKET_MB = 0.25  # the 1m model (~4 MB) goes in many buckets


@pytest.fixture
def trainer(tiny_model_dir: Path) -> Iterator[FSDPEngine]:
    engine = FSDPEngine(TrainEngineConfig(model=ModelConfig(path=str(tiny_model_dir)),
                                          optimizer=OptimizerConfig(lr=1e-3)))
    engine.initialize()
    yield engine
    engine.destroy()


def _fleet_client(addresses: list[str], backend: str = "sglang",
                  **config: object) -> RemoteInferenceEngine:
    config = {"weight_transport": "distributed", "weight_bucket_mb": BUCKET_MB,
              "weight_update_timeout": TIMEOUT_S, "retry_backoff": 0.1,
              "health_check_interval": 0.5, **config}
    client = make_engine(addresses, SGLANG_TEST_API_KEY, backend=backend, **config)
    client.set_version(max(fleet_version([a], SGLANG_TEST_API_KEY, backend)
                           for a in addresses))
    return client


def _perturb(engine: FSDPEngine, seed: int) -> None:
    """New trainer weights (as an optimizer step would make)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in engine.model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.add_(0.05 * torch.randn(local.shape, generator=gen).to(local.device))


def _export(engine: FSDPEngine, path: Path) -> Path:
    engine.save(SaveLoadMeta(path=str(path), weight_format="hf"))
    return path


def _assert_serves(client: RemoteSGLangEngine, weights: Path, version: int,
                   servers: set[str]) -> None:
    """Concurrent requests reach every server in `servers`, carry `version`, and their
    log-probs are those of `weights` (float64 reference)."""
    g = GenerationHyperparameters(max_new_tokens=12, temperature=1.0)

    async def many() -> list:
        return await asyncio.gather(*(client.agenerate(ModelRequest(input_ids=PROMPT, gconfig=g))
                                      for _ in range(6)))

    responses = asyncio.run(many())
    assert {r.metadata["server"] for r in responses} == servers
    for r in responses:
        assert r.output_versions == [version] * len(r.output_tokens)
        ref = hf_logprobs(weights, PROMPT, r.output_tokens)
        torch.testing.assert_close(torch.tensor(r.output_logprobs, dtype=torch.float64), ref,
                                   atol=LOGPROB_ATOL, rtol=0)


def _post(addr: str, path: str) -> dict:
    import json
    import urllib.request

    req = urllib.request.Request(f"http://{addr}{path}", b"{}",
                                 {"Authorization": f"Bearer {SGLANG_TEST_API_KEY}",
                                  "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.load(resp)


class _RecordedClient:
    """The fleet client as trainer rank 0's updater reaches it (in a run: across the rollout
    process's pipe, one round trip per call): records the name of every call."""

    def __init__(self, client: RemoteInferenceEngine) -> None:
        self.client, self.calls = client, []

    def __getattr__(self, name: str):
        method = getattr(self.client, name)

        def call(*args, **kwargs):
            self.calls.append(name)
            return method(*args, **kwargs)

        return call


class _Rank0Broadcaster(WeightBroadcaster):
    """A broadcaster with trainer rank 0's own HTTP client beside it (`updater`), for which
    `client` holds the fleet, as the rollout controller does in a run."""

    def __init__(self, client: RemoteInferenceEngine) -> None:
        super().__init__(client.config)
        self.told = _RecordedClient(client)
        self.updater = FleetUpdater(client.config, self.told)

    def push_to_fleet(self, engine: FSDPEngine, version: int) -> dict:
        return self.push(engine, self.updater, version)


def _leave(client: RemoteSGLangEngine, broadcaster: _Rank0Broadcaster) -> None:
    """The trainer's updater leaves its groups, then its broadcaster and the client end."""
    broadcaster.updater.close()
    broadcaster.close()
    client.destroy()


def test_servers_serve_the_trainers_weights_after_each_broadcast(
        trainer, any_fleet, tiny_model_dir, tmp_path):
    sglang_fleet = any_fleet  # either backend
    client = _fleet_client(sglang_fleet.addresses, sglang_fleet.config.backend)
    broadcaster = _Rank0Broadcaster(client)
    try:
        for step in range(3):
            _perturb(trainer, seed=step)
            version = client.get_version() + 1
            stats = broadcaster.push_to_fleet(trainer, version)
            assert stats["weight_sync/buckets"] > 1
            assert client.get_version() == trainer.get_version() == version
            assert not client.servers.out_of_service, client.servers.out_of_service
            assert fleet_version(sglang_fleet.addresses, SGLANG_TEST_API_KEY,
                                 sglang_fleet.config.backend) == version
            _assert_serves(client, _export(trainer, tmp_path / f"v{version}"), version,
                           set(sglang_fleet.addresses))
        assert broadcaster.formations == 2  # a group per server, formed once, then reused
        # every update, whatever its number of buckets, told the client twice: the rest went
        # from the trainer to the servers (HTTP and the process groups)
        assert broadcaster.told.calls == ["begin_weight_update", "end_weight_update"] * 3
    finally:
        _leave(client, broadcaster)
        restore_session_fleet(sglang_fleet, tiny_model_dir)


def test_a_request_in_flight_carries_both_versions(trainer, any_fleet, tiny_model_dir,
                                                   tmp_path):
    sglang_fleet = any_fleet  # either backend
    client = _fleet_client(sglang_fleet.addresses[:1], sglang_fleet.config.backend)
    broadcaster = _Rank0Broadcaster(client)
    old_weights = _export(trainer, tmp_path / "old")
    try:
        # no timing assumed: a broadcast before the first token is tried again later, one
        # after the last token earlier
        n_tokens, delay = 1000, 0.3
        for attempt in range(WINDOW_ATTEMPTS):
            old = client.get_version()
            _perturb(trainer, seed=100 + attempt)  # the server has the old ones until the push
            g = GenerationHyperparameters(max_new_tokens=n_tokens, min_new_tokens=n_tokens,
                                          temperature=1.0)
            future = asyncio.run_coroutine_threadsafe(
                client.agenerate(ModelRequest(input_ids=PROMPT, gconfig=g)),
                client._loop_thread.loop)
            deadline = time.monotonic() + 120
            while sum(client.inflight().values()) == 0 and not future.done():  # it is sent
                assert time.monotonic() < deadline, "the request reached no server in 120 s"
                time.sleep(0.01)
            time.sleep(delay)  # some tokens with the old weights
            broadcaster.push_to_fleet(trainer, old + 1)
            resp = future.result(timeout=300)
            if len(set(resp.output_versions)) == 2:
                break
            delay = delay * 2.5 if resp.output_versions[0] == old + 1 else delay / 4
            old_weights = _export(trainer, tmp_path / f"old{attempt}")
        else:
            pytest.fail("the broadcast never landed while a request was generating")
        new_weights = _export(trainer, tmp_path / "new")
        first = resp.output_versions.index(old + 1)
        assert first > 0
        assert resp.output_versions == [old] * first + [old + 1] * (n_tokens - first)
        banned = (eos_token_id(tiny_model_dir),)  # min_new_tokens: EOS was not allowed
        for weights, span in ((old_weights, slice(0, first)), (new_weights, slice(first, None))):
            ref = hf_logprobs(weights, PROMPT, resp.output_tokens, banned)[span]
            torch.testing.assert_close(
                torch.tensor(resp.output_logprobs[span], dtype=torch.float64), ref,
                atol=LOGPROB_ATOL, rtol=0)
    finally:
        _leave(client, broadcaster)
        restore_session_fleet(sglang_fleet, tiny_model_dir)


# a weight-update session opened, per backend (vLLM: its weight-transfer API)
BEGIN_UPDATE = {"sglang": "/begin_weight_update", "vllm": "/start_weight_update"}


def test_a_group_left_on_a_server_does_not_block_the_next_broadcaster(
        trainer, any_fleet, tiny_model_dir, tmp_path):
    """A server still holds a group of an earlier broadcaster of this process (its client went
    away without leaving) and a weight-update session it left open (as a trainer killed
    mid-broadcast does): the next broadcaster ends that session (refused to begin a second
    one, the server goes on), forms its own group and pushes."""
    sglang_fleet, backend = any_fleet, any_fleet.config.backend  # either backend
    server = sglang_fleet.addresses[:1]
    first_client = _fleet_client(server, backend)
    first = _Rank0Broadcaster(first_client)
    second_client = second = None
    try:
        first.push_to_fleet(trainer, first_client.get_version() + 1)
        first.close()  # the trainer's side is gone; the server keeps its side of the group
        _post(server[0], BEGIN_UPDATE[backend])  # ... and a session it never ended
        second_client = _fleet_client(server, backend)  # knows nothing of the first group
        second = _Rank0Broadcaster(second_client)
        _perturb(trainer, seed=7)
        version = second_client.get_version() + 1
        second.push_to_fleet(trainer, version)
        assert not second_client.servers.out_of_service, second_client.servers.out_of_service
        _assert_serves(second_client, _export(trainer, tmp_path / "v"), version, set(server))
    finally:
        if second_client is not None and second is not None:
            _leave(second_client, second)
        _leave(first_client, first)
        restore_session_fleet(sglang_fleet, tiny_model_dir)


def test_server_killed_between_broadcasts_the_run_goes_on_with_the_survivor(
        trainer, sglang_fleet, spare, tiny_model_dir, tmp_path):
    survivor, victim = sglang_fleet.addresses[0], spare.addresses[0]
    client = _fleet_client([survivor, victim], weight_broadcast_timeout=BROADCAST_TIMEOUT_S)
    broadcaster = _Rank0Broadcaster(client)
    try:
        _perturb(trainer, seed=1)
        broadcaster.push_to_fleet(trainer, client.get_version() + 1)
        assert broadcaster.formations == 2
        spare.kill_server(0)
        spare.processes[0].wait(timeout=60)
        _perturb(trainer, seed=2)
        version = client.get_version() + 1
        start = time.monotonic()
        broadcaster.push_to_fleet(trainer, version)  # rollout.weights.on_broadcast_failure=retry
        assert time.monotonic() - start < TIMEOUT_S  # within rollout.weights.update_timeout
        assert client.get_version() == version
        assert client.in_service() == [survivor] and victim in client.servers.out_of_service
        assert list(broadcaster.groups) == [survivor]  # the dead server's group is gone
        _assert_serves(client, _export(trainer, tmp_path / "new"), version, {survivor})
        # restarted (base weights, version 0), it forms a group of its own at the next update
        # and serves only after receiving it
        spare.restart_server(0)
        spare.wait_healthy(spare.config.startup_timeout)
        _perturb(trainer, seed=4)
        version = client.get_version() + 1
        broadcaster.push_to_fleet(trainer, version)
        assert sorted(client.in_service()) == sorted([survivor, victim])
        assert broadcaster.formations == 3
        assert fleet_version([victim], SGLANG_TEST_API_KEY) == version
        _assert_serves(client, _export(trainer, tmp_path / "newer"), version, {survivor, victim})
    finally:
        _leave(client, broadcaster)
        restore_session_fleet(sglang_fleet, tiny_model_dir)


def test_server_killed_during_a_broadcast_is_named_and_the_others_get_every_bucket(
        trainer, any_fleet, any_spare, tiny_model_dir, tmp_path, monkeypatch):
    sglang_fleet, spare = any_fleet, any_spare  # either backend
    survivor, victim = sglang_fleet.addresses[0], spare.addresses[0]
    client = _fleet_client([survivor, victim], sglang_fleet.config.backend,
                           on_weight_broadcast_failure="stop",
                           weight_broadcast_timeout=BROADCAST_TIMEOUT_S)
    broadcaster = _Rank0Broadcaster(client)
    real_receive = broadcaster.updater.api.receive_bucket
    buckets_posted = []

    async def receive_killing_victim(session, addr, body, timeout):
        if addr == victim:
            buckets_posted.append(body["names"])
            if len(buckets_posted) == 2:  # mid-broadcast: one bucket in, more to come
                spare.kill_server(0)
                spare.processes[0].wait(timeout=60)
        return await real_receive(session, addr, body, timeout)

    try:
        monkeypatch.setattr(broadcaster.updater.api, "receive_bucket", receive_killing_victim)
        _perturb(trainer, seed=3)
        version = client.get_version() + 1
        start = time.monotonic()
        with pytest.raises(WeightBroadcastFailed, match=victim) as info:
            broadcaster.push_to_fleet(trainer, version)
        # bounded by the broadcast timeout (plus the HTTP calls around it), not a hang
        assert time.monotonic() - start < TIMEOUT_S  # within rollout.weights.update_timeout
        assert "rollout.weights.on_broadcast_failure=stop" in str(info.value)
        assert survivor not in str(info.value)
        monkeypatch.undo()
        # the survivor's own group was untouched: it received every bucket and serves them
        assert client.in_service() == [survivor] and client.get_version() == version
        _assert_serves(client, _export(trainer, tmp_path / "new"), version, {survivor})
    finally:
        monkeypatch.undo()
        _leave(client, broadcaster)
        restore_session_fleet(sglang_fleet, tiny_model_dir)


def run_ranks(fleet: InferenceFleet, model_dir: Path, log_dir: Path, *extra: str,
              nproc: int = 2) -> list:
    """recipes/grpo.py under torchrun with `nproc` trainer ranks, on the session fleet."""
    import os
    import subprocess
    import sys

    from test_recipes import EQUIVALENCE

    from areal_like.utils.metrics_logger import read_metrics
    from engines.fleet.launch import find_free_port

    reset_fleet(fleet, model_dir)  # every run starts as on a fresh fleet (see _run_recipe)
    args = [f"model.path={model_dir}", f"logging.log_dir={log_dir}",
            f"rollout.server_addrs=[{','.join(fleet.addresses)}]",
            f"rollout.client.api_key={SGLANG_TEST_API_KEY}", "total_train_steps=3",
            "evaluation.n_prompts=4", "valid_dataset.size=8", "train_dataset.size=200",
            "logging.tensorboard=false", "logging.plot=false", *EQUIVALENCE, *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    cmd = [sys.executable, "-m", "areal_like.launcher.torchrun_loopback", f"--nproc_per_node={nproc}",
           "--master_addr=127.0.0.1", f"--master_port={find_free_port()}", "-m", "recipes.grpo",
           *args]
    try:
        proc = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[1], env=env,
                              capture_output=True, text=True, timeout=600)
    finally:
        reset_fleet(fleet, model_dir)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return read_metrics(next(log_dir.glob("*/trial0")) / "metrics.jsonl")


@pytest.mark.torchrun
def test_two_rank_trainer_broadcast_and_delta_equal_the_disk_transport(
        sglang_fleet, tiny_model_dir, tmp_path):
    """GRPO at eta = 0 with a 2-rank FSDP trainer and two servers, once per transport: the
    servers sample with seeds, so weights that differed would change tokens, rewards and the
    logged statistics; they are identical (those made from the servers' float32 log-probs to
    1e-6, see `assert_same_records`)."""
    from test_recipes import _compared

    disk = run_ranks(sglang_fleet, tiny_model_dir, tmp_path / "disk")
    dist = run_ranks(sglang_fleet, tiny_model_dir, tmp_path / "dist",
                          "rollout.weights.transport=distributed",
                          f"rollout.weights.bucket_mb={BUCKET_MB}")
    assert [r["step"] for r in dist] == [0, 1, 2, 3]
    assert_same_records([_compared(r) for r in disk], [_compared(r) for r in dist])
    assert all(r["weight_sync/buckets"] > 1 for r in dist[1:])
    assert "weight_sync/export_s" in disk[-1] and "weight_sync/export_s" not in dist[-1]
    assert not list((tmp_path / "dist").glob("*/trial0/weights/v*"))  # nothing on disk
    # only what changed, as weight files both servers apply (the first update whole: they
    # held no base); fed the same weights, the run is the disk run
    delta = run_ranks(sglang_fleet, tiny_model_dir, tmp_path / "delta",
                      "rollout.weights.transport=delta", f"rollout.weights.bucket_mb={BUCKET_MB}")
    assert_same_records([_compared(r) for r in disk], [_compared(r) for r in delta])
    assert [r["weight_sync/full_total"] for r in delta[1:]] == [2.0, 2.0, 2.0]
    assert [r["weight_sync/delta_total"] for r in delta[1:]] == [0.0, 2.0, 4.0]
    assert delta[1]["weight_sync/file_ratio"] < 1.0 and delta[2]["weight_sync/file_ratio"] > 0
    files = sorted(p.name for p in (tmp_path / "delta").glob("*/trial0/weights/delta/v*"))
    assert files == ["v2.delta", "v3.delta"], files  # the last two versions kept


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no GPU: the NCCL transport needs CUDA and a CUDA SGLang server")
def test_nccl_broadcast_to_a_cuda_server(tiny_model_dir, tmp_path):
    """The same check on a GPU: trainer on CUDA, one CUDA SGLang server (float32, as on the
    CPU), weights over NCCL."""
    from areal_like.api.config import ServerConfig

    fleet = InferenceFleet(tiny_model_dir, ServerConfig(n_servers=1, device="cuda",
                                                           context_length=1024),
                        api_key=SGLANG_TEST_API_KEY, log_dir=tmp_path / "gpu")
    with fleet:
        engine = FSDPEngine(TrainEngineConfig(model=ModelConfig(path=str(tiny_model_dir)),
                                              optimizer=OptimizerConfig(lr=1e-3)))
        engine.initialize()
        client = _fleet_client(fleet.addresses, weight_group_backend="nccl")
        broadcaster = _Rank0Broadcaster(client)
        try:
            assert broadcaster.backend == "nccl"
            for step in range(2):
                _perturb(engine, seed=step)
                version = client.get_version() + 1
                broadcaster.push_to_fleet(engine, version)
                _assert_serves(client, _export(engine, tmp_path / f"v{version}"), version,
                               set(fleet.addresses))
        finally:
            _leave(client, broadcaster)
            engine.destroy()
