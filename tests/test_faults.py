"""Fault injection against real servers (SGLang, and vLLM where a test takes `any_fleet`): a
server killed during a weight update, then restarted and readmitted with the current weights
(also one restarted when no request saw it down), a
server added to a running fleet, a server whose scheduler hangs behind a live HTTP front end,
`areal-like serve` restarting a server, the last server gone, and servers that answer
garbage, truncated JSON, HTTP 500, nothing at all or impossible log-probabilities.
Every wait is for an observable event (a server leaving or rejoining service, a reply)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import SGLANG_TEST_API_KEY
from fake_server import MisbehavingServer
from sglang_helpers import (
    fleet_version,
    hf_logprobs,
    make_controller,
    make_engine,
    perturbed_copy,
    process_tree,
    restore_session_fleet,
    server_pgid,
)

from areal_like.api.io_struct import GenerationHyperparameters, ModelRequest, WeightUpdateMeta
from areal_like.rollout import FleetUnavailableError
from engines.fleet.updater import FleetUpdater
from engines.server.errors import PoisonRequestError, RequestRejectedError

pytestmark = pytest.mark.sglang
PROMPT = [11, 22, 33, 44, 55]
BOUND_S = 300.0  # generous: only a hang gets near it
REPO = Path(__file__).resolve().parents[1]


def _until(predicate, what: str, timeout: float = BOUND_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _health(addr: str) -> int:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{addr}/health", timeout=60) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:  # connection refused: nothing listens (yet)
        return 0


@pytest.fixture
def new_weights(tiny_model_dir: Path, tmp_path: Path) -> Path:
    return perturbed_copy(tiny_model_dir, tmp_path / "perturbed", seed=11)


def test_server_killed_during_weight_update_leaves_survivor_serving_then_rejoins_updated(
        any_fleet, any_spare, tiny_model_dir, new_weights, monkeypatch):
    """Killed while paused for a load: the survivor is continued and serves the new version,
    the victim's requests move to it; restarted (with the base weights, labelled version 0),
    the victim serves again only after loading the current weights."""
    backend, spare = any_fleet.config.backend, any_spare
    survivor, victim = any_fleet.addresses[0], spare.addresses[0]
    engine = make_engine([survivor, victim], SGLANG_TEST_API_KEY, retry_backoff=0.1,
                         health_check_interval=0.5, backend=backend)
    engine.set_version(fleet_version([survivor], SGLANG_TEST_API_KEY, backend))
    # as in a run: trainer rank 0 pauses, loads and continues the servers itself; the client
    # (the rollout controller's) holds the fleet, continues what the pauses abort (vLLM) and
    # takes the failed server out when told
    updater = FleetUpdater(engine.config, engine)
    real_load = updater.api.load_from_disk

    async def load_killing_victim(session, addr, path, version, timeout):
        if addr == victim:
            spare.kill_server(0)  # paused, about to load: SIGKILL now
            spare.processes[0].wait(timeout=60)
        return await real_load(session, addr, path, version, timeout)

    monkeypatch.setattr(updater.api, "load_from_disk", load_killing_victim)
    try:
        version = engine.get_version() + 1
        g = GenerationHyperparameters(max_new_tokens=64, min_new_tokens=64, temperature=1.0)
        in_flight = [asyncio.run_coroutine_threadsafe(
            engine.agenerate(ModelRequest(input_ids=[5, i + 1], gconfig=g)), engine._loop_thread.loop)
            for i in range(6)]
        updater.update_weights(WeightUpdateMeta.from_disk(str(new_weights), version))
        assert engine.get_version() == version
        assert engine.in_service() == [survivor]
        # out for whichever it noticed first: the failed load or its dropped requests
        assert engine.servers.out_of_service[victim]
        assert _health(survivor) == 200  # continued, not left paused
        for fut in in_flight:  # requests on the victim were retried on the survivor
            resp = fut.result(timeout=BOUND_S)
            assert len(resp.output_tokens) == 64 and resp.metadata["server"] == survivor
        resp = asyncio.run(engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=g)))
        assert set(resp.output_versions) == {version}

        spare.restart_server(0)  # comes back with the base weights, labelled version 0
        _until(lambda: victim in engine.in_service(), "the restarted server to rejoin")
        # loaded before traffic
        assert fleet_version([victim], SGLANG_TEST_API_KEY, backend) == version
        assert engine.fleet_stats()["fleet/readmitted_total"] == 1
        # the restarted server computes with the new weights
        only_victim = make_engine([victim], SGLANG_TEST_API_KEY, backend=backend)
        only_victim.set_version(version)
        g = GenerationHyperparameters(max_new_tokens=8, temperature=1.0)
        resp = asyncio.run(only_victim.agenerate(ModelRequest(input_ids=PROMPT, gconfig=g)))
        only_victim.destroy()
        assert set(resp.output_versions) == {version}
        ref = hf_logprobs(new_weights, PROMPT, resp.output_tokens)
        assert max(abs(a - b) for a, b in zip(resp.output_logprobs, ref.tolist(), strict=True)) < 1e-4
    finally:
        monkeypatch.undo()
        updater.close()
        engine.destroy()
        restore_session_fleet(any_fleet, tiny_model_dir)


def test_server_restarted_between_requests_reloads_before_its_reply_counts(
        any_fleet, any_spare, tiny_model_dir, new_weights):
    """No request reaches the server while it is down, so only its first reply after the
    restart shows that it lost its weights (launch version). That reply is not used: the server
    leaves service, loads the current weights, and the request is answered with them."""
    backend, spare = any_fleet.config.backend, any_spare
    victim = spare.addresses[0]
    engine = make_engine([victim], SGLANG_TEST_API_KEY, retry_backoff=0.1,
                         health_check_interval=0.5, backend=backend)
    launch_version = fleet_version([victim], SGLANG_TEST_API_KEY, backend)
    engine.set_version(launch_version)
    try:
        version = launch_version + 1
        engine.update_weights(WeightUpdateMeta.from_disk(str(new_weights), version))
        spare.kill_server(0)
        spare.processes[0].wait(timeout=60)
        spare.restart_server(0)
        _until(lambda: _health(victim) == 200, "the restarted server to answer")
        assert fleet_version([victim], SGLANG_TEST_API_KEY, backend) == launch_version
        assert engine.in_service() == [victim]  # nothing has told the engine yet
        g = GenerationHyperparameters(max_new_tokens=8, temperature=1.0)
        resp = asyncio.run(engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=g)))
        assert set(resp.output_versions) == {version}
        stats = engine.fleet_stats()
        assert stats["fleet/taken_out_total"] == 1 and stats["fleet/readmitted_total"] == 1
        ref = hf_logprobs(new_weights, PROMPT, resp.output_tokens)
        assert max(abs(a - b) for a, b in zip(resp.output_logprobs, ref.tolist(), strict=True)) < 1e-4
    finally:
        engine.destroy()


def test_server_with_a_hung_scheduler_leaves_service_until_it_generates_again(
        any_fleet, any_spare):
    """The server's HTTP front end answers (the liveness probe passes) but nothing behind it
    runs (its scheduler and detokenizer are stopped): requests to it time out and go to the
    other server, a generation probe takes it out of service, and it comes back only once it
    generates again."""
    backend, spare = any_fleet.config.backend, any_spare
    survivor, victim = any_fleet.addresses[0], spare.addresses[0]
    engine = make_engine([survivor, victim], SGLANG_TEST_API_KEY, retry_backoff=0.1,
                         health_check_interval=0.5, request_timeout=5.0, backend=backend,
                         generation_probe_timeout=5.0)  # vLLM's; the SGLang spare's is 5 s too
    root = spare.processes[0].pid  # its HTTP front end; under it the engine's processes
    stopped = [pid for pid in process_tree(root) if pid != root]
    assert stopped, "the server has no child processes to stop"
    try:
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        g = GenerationHyperparameters(max_new_tokens=8, temperature=1.0)
        requests = [asyncio.run_coroutine_threadsafe(
            engine.agenerate(ModelRequest(input_ids=[9, i + 1], gconfig=g)), engine._loop_thread.loop)
            for i in range(4)]  # fewest in flight: some go to the victim
        assert all(r.result(timeout=BOUND_S).metadata["server"] == survivor for r in requests)
        _until(lambda: victim not in engine.membership._checking, "the probe of the victim")
        assert victim not in engine.in_service()
        probe = "/health_generate" if backend == "sglang" else "one-token probe"
        assert probe in engine.servers.out_of_service[victim]
        # the watch probes it again and keeps it out while it does not generate
        _until(lambda: "still not generating" in engine.servers.out_of_service.get(victim, ""),
               "a failed generation probe of the victim out of service")
        assert victim not in engine.in_service()
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        _until(lambda: victim in engine.in_service(), "the victim to come back")
        stats = engine.fleet_stats()
        assert stats["fleet/taken_out_total"] == 1 and stats["fleet/readmitted_total"] == 1
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        engine.destroy()


def test_server_killed_during_a_delta_update_gets_the_full_weights_when_it_is_back(
        sglang_fleet, spare, tiny_model_dir, tmp_path, monkeypatch):
    """The delta transport: a server killed while applying a weight file leaves service; the
    survivor goes on with deltas; restarted (launch weights, no base), the victim waits for
    the trainer's next update, which sends it the full version (counted), and it serves
    that version's log-probs."""
    from test_weight_broadcast import _assert_serves, _export
    from test_weight_delta import _small_step

    from areal_like.api.config import ModelConfig, OptimizerConfig, TrainEngineConfig
    from areal_like.runtime.weight_delta import WeightDeltaPusher
    from engines import FSDPEngine

    survivor, victim = sglang_fleet.addresses[0], spare.addresses[0]
    engine = make_engine([survivor, victim], SGLANG_TEST_API_KEY, retry_backoff=0.1,
                         health_check_interval=0.5, weight_transport="delta")
    engine.set_version(fleet_version([survivor], SGLANG_TEST_API_KEY))
    updater = FleetUpdater(engine.config, engine)
    pusher = WeightDeltaPusher(engine.config, tmp_path / "delta")
    trainer = FSDPEngine(TrainEngineConfig(model=ModelConfig(path=str(tiny_model_dir)),
                                           optimizer=OptimizerConfig(lr=1e-3)))
    trainer.initialize()
    real_apply = updater.api.apply_weight_file
    kill = {"on": False}

    async def apply_killing_victim(session, addr, path, version, timeout, model_digest=False):
        if addr == victim and kill["on"]:
            kill["on"] = False
            spare.kill_server(0)  # paused, about to apply: SIGKILL now
            await asyncio.to_thread(spare.processes[0].wait, 60)  # the survivor goes on
        return await real_apply(session, addr, path, version, timeout, model_digest)

    monkeypatch.setattr(updater.api, "apply_weight_file", apply_killing_victim)
    loader = updater.delta_loader
    try:
        version = engine.get_version() + 1
        pusher.push(trainer, updater, version)  # whole, to both
        kill["on"] = True
        _small_step(trainer, seed=1)
        pusher.push(trainer, updater, version + 1)
        assert engine.in_service() == [survivor] and victim in engine.servers.out_of_service
        assert loader.counts["delta"] == 1
        spare.restart_server(0)  # comes back with the launch weights, labelled version 0
        _until(lambda: _health(victim) == 200, "the restarted server to answer")
        # no folder to load: it waits for the trainer's next update
        assert victim in engine.membership.awaiting_broadcast
        assert victim not in engine.in_service()
        _small_step(trainer, seed=2)
        pusher.push(trainer, updater, version + 2)
        assert sorted(engine.in_service()) == sorted([survivor, victim])
        assert loader.counts["fallbacks_unknown_base"] == 1 and loader.counts["delta"] == 2
        assert fleet_version([survivor, victim], SGLANG_TEST_API_KEY) == version + 2
        _assert_serves(engine, _export(trainer, tmp_path / "now"), version + 2,
                       {survivor, victim})
    finally:
        monkeypatch.undo()
        updater.close()
        engine.destroy()
        trainer.destroy()
        restore_session_fleet(sglang_fleet, tiny_model_dir)


def test_server_added_through_the_addrs_file_joins_with_the_current_weights(
        sglang_fleet, spare, tiny_model_dir, new_weights, tmp_path):
    """A server listed in the addresses file joins once it loaded the current weights; one
    whose vocabulary is not the trainer's (here: a client told another vocabulary size) is
    refused, naming what differs, and never serves."""
    import json as json_

    first, added = sglang_fleet.addresses[0], spare.addresses[0]
    vocab = json_.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    addrs_file = tmp_path / "servers.txt"
    addrs_file.write_text(f"{first}\n{added}\n")
    for wrong, why in ((vocab + 3, "a smaller vocabulary"), (vocab - 1, "a larger vocabulary")):
        engine = make_engine([first], SGLANG_TEST_API_KEY, server_addrs_file=str(addrs_file),
                             health_check_interval=0.5, vocab_size=wrong)
        try:
            _until(lambda e=engine: added in e.membership.refused, "the server to be refused")
            assert why in engine.membership.refused[added]
            assert engine.in_service() == [first]
            assert engine.fleet_stats()["fleet/refused_total"] == 1
        finally:
            engine.destroy()
    addrs_file.write_text(f"{first}\n")
    engine = make_engine([first], SGLANG_TEST_API_KEY, server_addrs_file=str(addrs_file),
                         health_check_interval=0.5, vocab_size=vocab)
    engine.set_version(fleet_version([first], SGLANG_TEST_API_KEY))
    try:
        version = engine.get_version() + 1
        engine.update_weights(WeightUpdateMeta.from_disk(str(new_weights), version))
        addrs_file.write_text(f"{first}\n{added}  # a new server\n")
        _until(lambda: added in engine.in_service(), "the added server to join")
        assert fleet_version([added], SGLANG_TEST_API_KEY) == version
        assert engine.fleet_stats()["fleet/added_total"] == 1
    finally:
        engine.destroy()
        restore_session_fleet(sglang_fleet, tiny_model_dir)


@pytest.mark.e2e
def test_serve_restarts_a_dead_server_then_stops_naming_it(tiny_model_dir, tmp_path):
    """`areal-like serve`: a killed server is restarted on its address; once its restarts are
    used up, serve exits 1 naming the server, its signal and its log."""
    addrs_file = tmp_path / "addrs.txt"
    proc = subprocess.Popen(
        [sys.executable, "-m", "areal_like.cli", "serve", "--model-path", str(tiny_model_dir),
         "--n-servers", "1", "--max-restarts", "1", "--addrs-file", str(addrs_file),
         "--log-dir", str(tmp_path / "logs"), "--api-key", SGLANG_TEST_API_KEY,
         "--fork-children"],  # two starts, ~13 s less each
        cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        _until(addrs_file.exists, "serve to write its addresses")
        addr = addrs_file.read_text().split()[0]
        port = int(addr.rpartition(":")[2])
        old = server_pgid(port)
        os.killpg(old, signal.SIGKILL)
        _until(lambda: _pgid_or_none(port) not in (None, old), "the server to be restarted")
        _until(lambda: _health(addr) == 200, "the restarted server to answer")
        os.killpg(server_pgid(port), signal.SIGKILL)  # its one restart is used up
        _, err = proc.communicate(timeout=BOUND_S)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.communicate(timeout=60)
    assert proc.returncode == 1, err[-3000:]
    assert "restarting SGLang server 0 (restart 1 of 1)" in err
    assert f"SGLang server 0 ({addr}) died: killed by SIGKILL" in err
    assert "0 of 1 SGLang servers alive" in err and "server_0.log" in err


def test_a_joining_server_of_another_size_is_refused_naming_the_dimension(
        fresh_fleet, tiny_model_dir, tmp_path):
    """A server of the fleet's architecture and vocabulary but another width (hidden 64, not
    128) is refused when it joins, before any weight load could crash it: its config.json's
    dimensions against the fleet's, named in the refusal; it never serves."""
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    from areal_like.api.config import ServerConfig
    from areal_like.models.tiny import build_config
    from engines.fleet.launch import InferenceFleet

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = build_config("1m", tokenizer)
    config.hidden_size, config.intermediate_size = 64, 192
    narrow = tmp_path / "narrow"
    Qwen2ForCausalLM(config).save_pretrained(narrow, safe_serialization=True)
    tokenizer.save_pretrained(narrow)
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    assert json.loads((narrow / "config.json").read_text())["vocab_size"] == vocab
    first = fresh_fleet.addresses[0]  # its last load: tiny_model_dir, whose folder is compared
    with InferenceFleet(narrow, ServerConfig(n_servers=1, context_length=1024,
                                             fork_children=True),
                        api_key=SGLANG_TEST_API_KEY, log_dir=tmp_path / "logs") as other:
        addrs_file = tmp_path / "servers.txt"
        addrs_file.write_text(f"{first}\n{other.addresses[0]}\n")
        engine = make_engine([first], SGLANG_TEST_API_KEY, server_addrs_file=str(addrs_file),
                             health_check_interval=0.5, vocab_size=vocab)
        try:
            added = other.addresses[0]
            _until(lambda: added in engine.membership.refused, "the server to be refused")
            why = engine.membership.refused[added]
            assert "hidden_size 64 (fleet: 128)" in why and "intermediate_size 192" in why, why
            assert engine.in_service() == [first]
            assert other.dead_servers() == []  # refused before any load could crash it
        finally:
            engine.destroy()


def _pgid_or_none(port: int) -> int | None:
    try:
        return server_pgid(port)
    except LookupError:
        return None


def test_a_new_client_continues_a_server_left_paused(any_fleet):
    """A trainer killed mid-update leaves its servers paused; the next one must start."""
    addr, backend = any_fleet.addresses[1], any_fleet.config.backend
    dead_trainer = make_engine([addr], SGLANG_TEST_API_KEY, backend=backend)
    dead_trainer.pause()  # and never continues
    dead_trainer.destroy()
    engine = make_engine([addr], SGLANG_TEST_API_KEY, backend=backend)  # continues it
    try:
        g = GenerationHyperparameters(max_new_tokens=8, min_new_tokens=8)
        resp = asyncio.run(engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=g)))
        assert len(resp.output_tokens) == 8
    finally:
        engine.destroy()


def test_last_server_dead_stops_with_a_clear_bounded_error(any_fleet, any_spare):
    spare, addr = any_spare, any_spare.addresses[0]
    controller = make_controller([addr], SGLANG_TEST_API_KEY, retry_backoff=0.1,
                                 server_down_timeout=5.0, health_check_interval=0.5,
                                 backend=any_fleet.config.backend)
    engine = controller.engine
    try:
        spare.kill_server(0)
        spare.processes[0].wait(timeout=60)
        g = GenerationHyperparameters(max_new_tokens=8)
        start = time.monotonic()
        with pytest.raises(FleetUnavailableError, match=addr) as info:
            asyncio.run(engine.agenerate(ModelRequest(input_ids=PROMPT, gconfig=g)))
        assert "server_down_timeout" in str(info.value)
        assert time.monotonic() - start < BOUND_S
        # the executor stops too: every wait raises the same error, naming the server
        _until(lambda: engine.membership.fatal is not None, "the fleet watch to give up")
        with pytest.raises(FleetUnavailableError, match=addr):
            controller.wait(1, timeout=BOUND_S)
    finally:
        controller.destroy()


def test_a_request_that_kills_its_server_costs_one_error_not_the_restarts(spare,
                                                                          tiny_model_dir):
    """A prompt naming a token id past the embedding ends an SGLang scheduler (0.5.23 checks
    no prompt ids). A client that knows the vocabulary (`rollout.vocab_size`, as every recipe
    sets it) refuses it naming the id, and the server serves on. One that does not sends it:
    the server dies, the request waits and is sent once more when the server is back (restarted
    here as a supervisor would), kills it again, and is then a PoisonRequestError, not sent a
    third time: the damage is bounded whatever the restart budget."""
    addr = spare.addresses[0]
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    poison = ModelRequest(input_ids=[5, vocab + 7], gconfig=GenerationHyperparameters(
        max_new_tokens=4))
    knows = make_engine([addr], SGLANG_TEST_API_KEY, vocab_size=vocab)
    try:
        with pytest.raises(RequestRejectedError, match=rf"input_ids\[1\] = {vocab + 7} is outside"):
            asyncio.run(knows.agenerate(poison))
        good = asyncio.run(knows.agenerate(ModelRequest(
            input_ids=PROMPT, gconfig=GenerationHyperparameters(max_new_tokens=4))))
        assert len(good.output_tokens) == 4
    finally:
        knows.destroy()
    blind = make_engine([addr], SGLANG_TEST_API_KEY, retry_backoff=0.1, request_retries=5,
                        health_check_interval=0.5, server_down_timeout=BOUND_S)
    try:
        sent = asyncio.run_coroutine_threadsafe(blind.agenerate(poison),
                                                blind._loop_thread.loop)
        spare.processes[0].wait(timeout=BOUND_S)  # the first death
        spare.kill_server(0)  # whatever of its process group is left
        spare.restart_server(0)
        with pytest.raises(PoisonRequestError, match="dropped it mid-way 2 times") as info:
            sent.result(timeout=BOUND_S)
        assert str(info.value).count(addr) == 2, info.value
        spare.processes[0].wait(timeout=BOUND_S)  # the second death, and no third send
    finally:
        blind.destroy()


# ---- servers that misbehave -----------------------------------------------------------------

@pytest.mark.parametrize("mode", ["garbage", "truncated", "http500",
                                  pytest.param("silent", marks=pytest.mark.e2e),  # waits ~10 s
                                  "impossible_logprobs"])
def test_misbehaving_server_requests_are_retried_on_a_real_one(sglang_fleet, mode):
    bad = MisbehavingServer(mode)
    bad_addr, good = f"127.0.0.1:{bad.port}", sglang_fleet.addresses[0]
    # 'silent' waits out request_timeout; a real 8-token reply takes well under a second, on
    # a machine beside two busy processes too
    engine = make_engine([bad_addr, good], SGLANG_TEST_API_KEY, retry_backoff=0.05,
                         request_timeout=10.0, request_retries=3)
    engine.set_version(fleet_version([good], SGLANG_TEST_API_KEY))
    try:
        g = GenerationHyperparameters(max_new_tokens=8, min_new_tokens=8, temperature=1.0)

        async def many():
            return await asyncio.gather(*(engine.agenerate(
                ModelRequest(input_ids=[9, i + 1], gconfig=g)) for i in range(4)))

        resps = asyncio.run(many())
        assert bad.requests >= 1, "the bad server was never tried"
        for r in resps:  # every request got a real answer from the real server
            assert r.metadata["server"] == good and len(r.output_tokens) == 8
            assert all(lp <= 0 for lp in r.output_logprobs)
    finally:
        engine.destroy()
        bad.stop()


def test_only_liveness_probes_answer_without_the_api_key(sglang_fleet):
    """With an API key, every endpoint but the documented probes (/health*) says 401."""
    import urllib.error
    import urllib.request

    addr = sglang_fleet.addresses[0]
    answered = {}
    for method, path in [("GET", "/health"), ("GET", "/model_info"), ("GET", "/server_info"),
                         ("POST", "/generate"), ("POST", "/pause_generation"),
                         ("POST", "/continue_generation"), ("POST", "/update_weights_from_disk"),
                         ("POST", "/abort_request"), ("POST", "/flush_cache"),
                         ("GET", "/v1/models"), ("POST", "/v1/completions")]:
        req = urllib.request.Request(f"http://{addr}{path}", method=method,
                                     data=b"{}" if method == "POST" else None,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                answered[path] = resp.status
        except urllib.error.HTTPError as e:
            answered[path] = e.code
    assert answered.pop("/health") == 200
    assert set(answered.values()) == {401}, answered


@pytest.mark.e2e
def test_a_server_joins_a_running_job_at_step_5_and_is_drained_at_step_10(
        sglang_fleet, spare, tiny_model_dir, tmp_path):
    """An elastic fleet under a GRPO run (delta transport, eta = 0): the spare is listed in
    the job's addresses file once step 5 is logged (it gets the full weights at the trainer's
    next update, then deltas) and taken out once a step has been logged with it in service:
    it drains (`<file>.drained` lists it) while the run goes on. Every step is logged once,
    every episode trained once, and the trainer's recomputed log-probs equal the servers' at
    every step: both servers served the trainer's current weights."""
    from areal_like.utils.metrics_logger import read_metrics

    first, joiner = sglang_fleet.addresses[0], spare.addresses[0]
    addrs_file = tmp_path / "servers.txt"
    addrs_file.write_text(f"{first}\n")
    steps = 16
    restore_session_fleet(sglang_fleet, tiny_model_dir)
    args = [f"model.path={tiny_model_dir}", f"logging.log_dir={tmp_path}",
            f"rollout.server_addrs=[{first}]", f"rollout.server_addrs_file={addrs_file}",
            f"rollout.client.api_key={SGLANG_TEST_API_KEY}", f"total_train_steps={steps}",
            "rollout.weights.transport=delta", "rollout.health.check_interval=0.5",
            "gconfig.n_samples=4", "gconfig.max_new_tokens=6", "train_dataset.batch_size=4",
            "rollout.staleness.consumer_batch_size=4", "train_dataset.size=400",
            "rollout.staleness.max_head_offpolicyness=0", "evaluation.freq_steps=100",
            "evaluation.n_prompts=4", "valid_dataset.size=8", "logging.tensorboard=false",
            "logging.plot=false"]
    log = tmp_path / "run.log"
    with open(log, "w") as out_file:
        proc = subprocess.Popen([sys.executable, "-m", "recipes.grpo", *args], cwd=REPO,
                                env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=out_file,
                                stderr=subprocess.STDOUT, text=True)
    run = tmp_path / "grpo_addition" / "trial0"

    def running(what: str) -> bool:
        assert proc.poll() is None, f"the run ended before {what}: {log.read_text()[-3000:]}"
        return True

    def logged(done: Callable[[dict], bool]) -> bool:
        path = run / "metrics.jsonl"
        return path.exists() and any(done(r) for r in read_metrics(path))

    drained = Path(f"{addrs_file}.drained")
    try:
        _until(lambda: running("step 5") and logged(lambda r: r["step"] >= 5), "step 5")
        addrs_file.write_text(f"{first}\n{joiner}\n")
        _until(lambda: running("the join") and logged(lambda r: r.get("fleet/in_service") == 2),
               "a step with the joined server in service")
        addrs_file.write_text(f"{first}\n")
        _until(lambda: running("the drain") and drained.exists(), "the joined server to drain")
        proc.wait(timeout=BOUND_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
        restore_session_fleet(sglang_fleet, tiny_model_dir)
    assert proc.returncode == 0, log.read_text()[-4000:]
    assert drained.read_text() == f"{joiner}\n"
    records = [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    episodes = [json.loads(line) for line in (run / "episodes.jsonl").read_text().splitlines()]
    trained = [i for e in episodes if "trained" in e for i in e["trained"]]
    assert len(trained) == len(set(trained)) == steps * 4
    gaps = [r["actor/gap/abs_log_diff/max"] for r in records]
    assert max(gaps) < 1e-3, gaps
    served = [r["fleet/in_service"] for r in records]
    assert served[0] == 1 and 2.0 in served, served
    last = records[-1]
    assert last["fleet/added_total"] == 1
    assert last["weight_sync/fallbacks_unknown_base_total"] == 1  # the joiner's full load


@pytest.mark.e2e
def test_serve_join_adds_its_server_to_a_running_fleet_and_leaves_it_drained(
        sglang_fleet, tiny_model_dir, tmp_path):
    """`areal-like serve --join <file>`: its server joins a running client's fleet through the
    addresses file (loaded with the current weights); on SIGTERM it takes the line out, waits
    until the client lists it in `<file>.drained`, then stops and exits 0."""
    first = sglang_fleet.addresses[0]
    addrs_file = tmp_path / "servers.txt"
    addrs_file.write_text(f"{first}\n")
    engine = make_engine([first], SGLANG_TEST_API_KEY, server_addrs_file=str(addrs_file),
                         health_check_interval=0.5)
    engine.set_version(fleet_version([first], SGLANG_TEST_API_KEY))
    version = engine.get_version() + 1  # what the joined server must load before it serves
    engine.update_weights(WeightUpdateMeta.from_disk(str(tiny_model_dir), version))
    proc = subprocess.Popen(
        [sys.executable, "-m", "areal_like.cli", "serve", "--model-path", str(tiny_model_dir),
         "--n-servers", "1", "--join", str(addrs_file), "--log-dir", str(tmp_path / "logs"),
         "--api-key", SGLANG_TEST_API_KEY, "--fork-children"],
        cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    try:
        _until(lambda: len(engine.in_service()) == 2, "the joined server to serve")
        joined = next(a for a in engine.in_service() if a != first)
        assert fleet_version([joined], SGLANG_TEST_API_KEY) == version
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=BOUND_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=60)
        engine.destroy()
        restore_session_fleet(sglang_fleet, tiny_model_dir)
    assert proc.returncode == 0, out[-3000:]
    assert f"[serve] drained: {joined}" in out
    assert addrs_file.read_text() == f"{first}\n"
    assert Path(f"{addrs_file}.drained").read_text() == f"{joined}\n"


@pytest.mark.e2e
@pytest.mark.beside_serial  # servers of its own, no session fleet
def test_serve_join_needs_a_running_job_and_stops_at_once_when_nothing_is_left_to_drain(
        tiny_model_dir, tmp_path):
    """`serve --join` is refused before any server starts (exit 2, naming why) into a folder
    that does not exist and into a file no job reads. Joined to a running job (a real fleet
    client reading the file, its heartbeat fresh) that never drains it, a SIGTERM takes its
    line out and waits, and a second stops it at once; joined again, the job ends while serve
    waits for the drain, and serve stops at once, saying so. Exit 0, no traceback, the job's
    own line kept."""
    from config_helpers import rollout_config

    from engines.fleet.client import RemoteInferenceEngine

    serve = [sys.executable, "-m", "areal_like.cli", "serve", "--model-path", str(tiny_model_dir),
             "--n-servers", "1", "--log-dir", str(tmp_path / "logs"), "--fork-children"]
    addrs_file = tmp_path / "servers.txt"
    addrs_file.write_text("127.0.0.1:1\n")  # the job's line, which must stay
    for target, why in ((tmp_path / "no_such_job" / "servers.txt", "no folder"),
                        (addrs_file, "no job reads it")):
        refused = subprocess.run([*serve, "--join", str(target)], cwd=REPO, capture_output=True,
                                 text=True, timeout=BOUND_S)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert f"--join {target}: {why}" in refused.stderr
        assert "servers ready" not in refused.stdout
    # the job: a fleet client of the file that reads it once (its next read is an hour away)
    job = RemoteInferenceEngine(rollout_config(server_addrs=["127.0.0.1:1"],
                                               server_addrs_file=str(addrs_file),
                                               health_check_interval=3600.0))
    job.initialize(check_health=False)
    try:
        for ending in ("a second signal", "the job ends"):
            out_path = tmp_path / f"serve_{ending[-4:]}.out"
            with open(out_path, "w") as out:
                proc = subprocess.Popen([*serve, "--join", str(addrs_file)], cwd=REPO,
                                        env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=out,
                                        stderr=subprocess.STDOUT, text=True)
            try:
                _until(lambda p=out_path: "[serve] joined the job" in p.read_text(), "the join")
                assert len(addrs_file.read_text().splitlines()) == 2
                proc.send_signal(signal.SIGTERM)
                _until(lambda p=out_path: "waiting for it to drain" in p.read_text(),
                       "the drain wait")
                if ending == "a second signal":
                    proc.send_signal(signal.SIGTERM)
                else:
                    job.destroy()
                proc.wait(timeout=BOUND_S)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=60)
            text = out_path.read_text()
            assert proc.returncode == 0 and "Traceback" not in text, text[-3000:]
            assert ("stopping without waiting for the drain" in text) == (ending != "the job ends")
            assert ("has ended (no client reads the file): nothing to drain" in text) == (
                ending == "the job ends"), text[-3000:]
            assert addrs_file.read_text() == "127.0.0.1:1\n"
    finally:
        job.destroy()
    assert not list(tmp_path.glob("servers.txt.client.*"))  # the ended job's heartbeat is gone
