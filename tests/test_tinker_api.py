"""`areal-like tinker-serve` driven by the real `tinker` SDK (unmodified, pointed at it by its
base URL): one server for the module, with two FSDP2 trainer ranks and one SGLang server
serving the adapters. Log-probs are checked against HF + PEFT in float64 on the checkpoints
the server wrote."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from areal_like.utils.network import find_free_port

# its own server and fleet: beside the serial lane (tests/conftest.py)
pytestmark = [pytest.mark.sglang, pytest.mark.e2e, pytest.mark.beside_serial]
API_KEY = "tml-areal-like-test"
# the cookbook's default model: its renderer (role_colon) is chosen by this name, and its
# tokenizer is loaded from a folder of that name in the working directory (docs/tinker.md)
MODEL_NAME = "Qwen/Qwen3.5-9B-Base"
SESSION_TIMEOUT_S = 30.0  # (the SDK heartbeats every 10 s; tinker-serve takes >= 20 s)
PARITY_TOL = 1e-4
STEPS = 12  # float32 trainer / server against the float64 reference, per token


class Server:
    def __init__(self, url: str, storage: Path, process: subprocess.Popen[bytes],
                 log: Path) -> None:
        self.url, self.storage, self.process, self.log = url, storage, process, log

    def stats(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.url}/areal_like/stats", timeout=30) as reply:
            stats: dict[str, Any] = json.loads(reply.read())
        return stats

    def folder(self, tinker_path: str) -> Path:
        """Where the server keeps a checkpoint (docs/tinker.md: the storage layout)."""
        model_id, kind, name = tinker_path.removeprefix("tinker://").split("/")
        return self.storage / model_id.replace(":", "_") / kind / name

    def client(self) -> Any:
        return self.client_with_key(API_KEY)

    def client_with_key(self, api_key: str) -> Any:
        return tinker.ServiceClient(base_url=self.url, api_key=api_key)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    from sglang_helpers import require_sglang_venv

    require_sglang_venv()
    root = tmp_path_factory.mktemp("tinker")
    port = find_free_port()
    log = root / "serve.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TINKER_TELEMETRY": "0"}
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "areal_like.cli", "tinker-serve",
             "--model-path", str(tiny_model_dir), "--model-name", MODEL_NAME,
             "--port", str(port),
             "--storage-dir", str(root / "storage"), "--log-dir", str(root / "logs"),
             "--trainer-ranks", "2", "--max-lora-rank", "8",  # (any tml- key: two callers)
             "--session-timeout", str(SESSION_TIMEOUT_S), "--poll-wait", "5",
             "--fork-children"],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    while True:  # ready once it answers; it never answering is its exit or its log
        try:
            urllib.request.urlopen(f"{url}/api/v1/healthz", timeout=5).close()
            break
        except OSError:
            pass
        assert process.poll() is None, f"tinker-serve exited:\n{log.read_text()[-3000:]}"
        assert time.monotonic() - started < 600, f"not up in 600 s:\n{log.read_text()[-3000:]}"
        time.sleep(0.5)
    yield Server(url, root / "storage", process, log)
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise
    assert process.returncode == 0, log.read_text()[-3000:]


@pytest.fixture
def client(server: Server) -> Iterator[Any]:
    """A ServiceClient whose session finishes (and frees its models) with the test."""
    with server.client() as service_client:
        yield service_client


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> Any:
    """log p(targets) under float64 HF base + the PEFT adapter folder given."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    def logprobs(adapter_folder: Path, tokens: list[int], start: int) -> torch.Tensor:
        """log p(tokens[t] | tokens[:t]) for t >= start."""
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64,
                                                    attn_implementation="eager")
        model = PeftModel.from_pretrained(base, adapter_folder).double().eval()
        with torch.no_grad():
            logp = model(input_ids=torch.tensor([tokens])).logits[0].log_softmax(-1)
        return torch.stack([logp[t - 1, tokens[t]] for t in range(start, len(tokens))])
    return logprobs


def _datum(tokens: list[int], weights: list[float]) -> Any:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights[1:]})


def test_supervised_loop_learns_and_its_adapter_matches_hf_peft(server: Server, client: Any,
                                                                reference: Any) -> None:
    """Cross-entropy on four counting sequences (two datums per rank): the loss falls; the
    sampler checkpoint's log-probs on the fleet and the trainer's own equal HF + PEFT's."""
    training = client.create_lora_training_client(base_model=MODEL_NAME, rank=8).result()
    sequences = [list(range(start, start + 12)) for start in (20, 90, 200, 310)]
    data = [_datum(s, [0.0] * 4 + [1.0] * 8) for s in sequences]
    losses = []
    for _ in range(STEPS):
        step = training.forward_backward(data, "cross_entropy")
        optim = training.optim_step(types.AdamParams(learning_rate=5e-3))
        losses.append(step.result().metrics["loss:sum"])
        assert optim.result().metrics["update_successful:mean"] == 1.0
    # (measured: 198 -> 128 over 12 steps; uniform guessing is 32 * log(512) = 200)
    assert losses[-1] < 0.75 * losses[0] and losses == sorted(losses, reverse=True), losses

    path = training.save_weights_for_sampler("sl-final").result().path
    folder = server.folder(path)
    sampler = client.create_sampling_client(model_path=path).result()
    prompt = sequences[1]
    served = sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    want = reference(folder, prompt, 1)
    assert served[0] is None
    assert float((torch.tensor(served[1:], dtype=torch.float64) - want).abs().max()) < PARITY_TOL
    trained = training.forward([data[1]], "cross_entropy").result()
    got = torch.tensor(trained.loss_fn_outputs[0]["logprobs"].tolist(), dtype=torch.float64)
    assert float((got - want).abs().max()) < PARITY_TOL
    assert json.loads((folder / "tinker_checkpoint.json").read_text())["step"] == STEPS



def _rl_datum(prompt: list[int], sample: Any, advantage: float) -> Any:
    """Tinker's RL datum: the whole sequence but its last token in, each next token as the
    target; the sampler's log-probs and the advantage on the sampled positions only."""
    tokens = prompt + list(sample.tokens)
    n_prompt = len(prompt) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:],
                        "logprobs": [0.0] * n_prompt + list(sample.logprobs),
                        "advantages": [0.0] * n_prompt + [advantage] * len(sample.tokens)})


def test_rl_loop_samples_from_each_new_adapter(server: Server, client: Any,
                                              reference: Any) -> None:
    """sample -> score -> forward_backward(importance_sampling) -> optim_step -> save for the
    sampler -> sample again: the trainer's log-probs of the first samples are the sampler's
    (on-policy: ratio 1); the second samples are the new adapter's (HF + PEFT log-probs of
    the checkpoint after one step), not the old one's."""
    training = client.create_lora_training_client(base_model=MODEL_NAME, rank=8).result()
    prompts = [[11, 12, 13, 14], [40, 41, 42]]
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    samplers, folders = [], []
    for step in range(2):
        samplers.append(training.save_weights_and_get_sampling_client().result())
        folders.append(_sampler_folder(server, samplers[-1]))
        assert json.loads((folders[-1] / "tinker_checkpoint.json").read_text())["step"] == step
        replies = [samplers[-1].sample(types.ModelInput.from_ints(p), 4, params).result()
                   for p in prompts]
        samples = [(p, s) for p, r in zip(prompts, replies, strict=True) for s in r.sequences]
        assert all(len(s.tokens) == len(s.logprobs) > 0 for _, s in samples)
        for prompt, sample in samples[::3]:  # the fleet samples from this step's adapter
            want = reference(folders[-1], prompt + list(sample.tokens), len(prompt))
            got = torch.tensor(sample.logprobs, dtype=torch.float64)
            assert float((got - want).abs().max()) < PARITY_TOL, step
            if step:
                old = reference(folders[0], prompt + list(sample.tokens), len(prompt))
                assert float((got - old).abs().max()) > 10 * PARITY_TOL, "the old adapter"
        if step:
            break
        # reward: how many of the sampled tokens are even ids; advantage: minus the group mean
        rewards = [sum(t % 2 == 0 for t in s.tokens) / len(s.tokens) for _, s in samples]
        data = [_rl_datum(p, s, r - float(np.mean(rewards)))
                for (p, s), r in zip(samples, rewards, strict=True)]
        out = training.forward_backward(data, "importance_sampling").result()
        for (prompt, sample), datum_out in zip(samples, out.loss_fn_outputs, strict=True):
            trained = datum_out["logprobs"].tolist()[len(prompt) - 1:]
            assert np.allclose(trained, sample.logprobs, atol=PARITY_TOL)
        training.optim_step(types.AdamParams(learning_rate=5e-2)).result()


def _sampler_folder(server: Server, sampler: Any) -> Path:
    """The checkpoint a sampling session samples from (GET /samplers/<id>)."""
    with urllib.request.urlopen(urllib.request.Request(
            f"{server.url}/api/v1/samplers/{sampler._sampling_session_id}",
            headers={"X-API-Key": API_KEY}), timeout=30) as reply:
        return server.folder(json.loads(reply.read())["model_path"])


def test_errors_reach_the_sdk_as_its_own_exceptions(server: Server, client: Any) -> None:
    """An unknown model (or one never created), checkpoint or base model: the SDK's HTTP
    error types; an unsupported loss or a bad datum: the failed future's RequestFailedError,
    after which the model still trains."""
    training = client.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
    datum = _datum([1, 2, 3, 4], [1.0] * 4)
    never_created = tinker.TrainingClient(
        client.holder, model_seq_id=9, model_id=training.model_id.rsplit(":", 1)[0] + ":9",
        info=training.get_info())
    with pytest.raises(tinker.NotFoundError, match="create_model first"):
        never_created.forward([datum], "cross_entropy").result()
    with pytest.raises(tinker.NotFoundError, match="no checkpoint"):
        client.create_sampling_client(
            model_path="tinker://nobody:train:0/sampler_weights/x").result()
    with pytest.raises(tinker.BadRequestError, match="is not served here"):
        client.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4).result()
    with pytest.raises(tinker.BadRequestError, match="LoRA ranks 1..8"):
        client.create_lora_training_client(base_model=MODEL_NAME, rank=64).result()
    with pytest.raises(tinker.RequestFailedError, match="'dro' is not supported") as failed:
        training.forward_backward([datum], "dro").result()
    assert failed.value.category == "user"
    bad = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 10**6]),
                      loss_fn_inputs={"target_tokens": [2, 3, 4]})
    with pytest.raises(tinker.RequestFailedError, match="outside the vocabulary"):
        training.forward_backward([bad], "cross_entropy").result()
    nll = training.forward([datum], "cross_entropy").result().metrics["loss:sum"]
    # the SDK's client-side custom loss: a forward, then cross_entropy with weights -dC/dlp
    custom = training.forward_backward_custom(
        [datum], lambda data, logprobs: (-2.0 * sum(lp.sum() for lp in logprobs), {}))
    assert custom.result().metrics["loss:sum"] == pytest.approx(2 * nll, rel=1e-5)
    assert server.stats()["pending_futures"] == 0


def test_the_door_holds_poison_requests_bad_datums_and_other_keys(server: Server,
                                                                   client: Any) -> None:
    """A prompt token id past the vocabulary (it would crash the SGLang server: IndexError in
    the embedding) is the SDK's BadRequestError and the server samples the next request; a
    datum without tokens fails its own future and uses its seq_id (the model's next call runs
    without waiting for the seq_id gap); another key's client finds neither the model, its
    seq_ids nor its training run; a call without a key gets 401 with a JSON message."""
    training = client.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
    sampler = client.create_sampling_client(base_model=MODEL_NAME).result()
    params = types.SamplingParams(max_tokens=4, temperature=0.0)
    for prompt in ([1, 2, 10**6], [-1, 2, 3]):
        with pytest.raises(tinker.BadRequestError, match="outside the vocabulary"):
            sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result()
    assert sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 1, params).result().sequences
    empty = types.Datum(model_input=types.ModelInput.from_ints([]),
                        loss_fn_inputs={"target_tokens": []})
    with pytest.raises(tinker.RequestFailedError, match="has no tokens"):
        training.forward_backward([empty], "cross_entropy").result()
    datum = _datum([1, 2, 3, 4], [1.0] * 4)
    nll = training.forward([datum], "cross_entropy").result().metrics["loss:sum"]
    assert "never arrived" not in server.log.read_text()  # (the gap was not waited out)

    with server.client_with_key("tml-someone-else") as other:
        stranger = tinker.TrainingClient(other.holder, model_seq_id=0,
                                         model_id=training.model_id, info=training.get_info())
        with pytest.raises(tinker.NotFoundError, match="no model"):
            stranger.forward([datum], "cross_entropy").result()
        rest = tinker.RestClient(base_url=server.url, api_key="tml-someone-else")  # nor its run
        listed = rest.list_training_runs().result().training_runs
        assert training.model_id not in [run.training_run_id for run in listed]
        with pytest.raises(tinker.NotFoundError, match="no training run"):
            rest.get_training_run(training.model_id).result()
    owners = tinker.RestClient(base_url=server.url, api_key=API_KEY)
    assert owners.get_training_run(training.model_id).result().training_run_id == \
        training.model_id
    assert training.forward([datum], "cross_entropy").result().metrics["loss:sum"] == \
        pytest.approx(nll, rel=1e-6)  # its own seq_ids go on as before
    request = urllib.request.Request(f"{server.url}/api/v1/create_session", data=b"{}",
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 401
    assert json.loads(refused.value.read())["detail"] == "missing or wrong X-API-Key"
    assert server.process.poll() is None and server.stats()["pending_futures"] == 0


FUZZ_KEY = "tml-fuzz"
VOCAB = 512  # the tiny model's


def _fuzz_calls(live: dict[str, str]) -> Any:
    """(method, path, body bytes, content type) of hostile Tinker calls: every JSON endpoint
    with bodies of its own fields, the REST views with odd ids, forward_backward with data the
    SDK encodes (token ids past the vocabulary, lengths that disagree, NaN weights, unknown
    losses), and bytes that are no request at all. `live`: the fuzzing key's own session,
    model, sampler and checkpoint, so the requests reach past the lookups."""
    from door_fuzz import JSON_VALUES, bodies, json_bytes, near, raw_bodies
    from hypothesis import strategies as st
    from tinker.proto import request_conv

    ids = st.sampled_from(list(live.values()))
    ints = st.integers(min_value=0, max_value=VOCAB - 1) | st.sampled_from([-1, VOCAB, 2**40])
    int32 = st.integers(0, VOCAB + 3) | st.sampled_from([10**6, 2**31 - 1])  # the SDK's wire
    token_lists = st.lists(ints, max_size=8)
    prompt = st.fixed_dictionaries({"chunks": st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["encoded_text", "encoded_text", "image"]),
         "tokens": token_lists}), min_size=1, max_size=3)})
    sampling = st.fixed_dictionaries({"max_tokens": st.integers(1, 4) | st.sampled_from(
        [0, -1, 10**9, 2**64])}, optional={"temperature": st.floats(0, 2),
        "top_p": st.floats(0.1, 1), "top_k": st.integers(-1, 50), "seed": st.integers(),
        "stop": st.lists(st.text(max_size=4) | ints, max_size=3)})
    session, model = st.just(live["session"]), st.just(live["model"])
    seq = st.integers(1, 40)  # (a seq_id ahead of the model's waits its turn: "still waiting")
    adapter, state = st.just(live["checkpoint"]), st.just(live["state"])
    templates = {
        "create_session": {"tags": st.just([]), "user_metadata": st.just({}),
                           "sdk_version": st.just("0.38.0")},
        "session_heartbeat": {"session_id": session},
        "create_model": {"session_id": session, "model_seq_id": st.integers(1, 3),
                         "base_model": st.just(MODEL_NAME), "user_metadata": st.just({}),
                         "lora_config": st.fixed_dictionaries({"rank": st.integers(1, 8)})},
        "get_info": {"model_id": model},
        "optim_step": {"model_id": model, "seq_id": seq, "adam_params": st.fixed_dictionaries(
            {"learning_rate": st.floats(0, 1e-3)})},
        "save_weights": {"model_id": model, "seq_id": seq, "path": st.just("fz")},
        "save_weights_for_sampler": {"model_id": model, "seq_id": seq, "path": st.just("fz")},
        "load_weights": {"session_id": session, "path": state, "model_seq_id": st.integers(4, 6),
                         "optimizer": st.booleans()},
        "create_sampling_session": {"session_id": session, "model_path": adapter,
                                    "sampling_session_seq_id": st.integers(1, 9)},
        "asample": {"sampling_session_id": st.just(live["sampler"]), "prompt": prompt,
                    "num_samples": st.integers(1, 2), "sampling_params": sampling,
                    "prompt_logprobs": st.booleans()},
        "weights_info": {"tinker_path": adapter | state},
        "retrieve_future": {"request_id": st.text(max_size=12)},
    }
    json_posts = st.sampled_from(sorted(templates)).flatmap(lambda name: st.tuples(
        st.just("POST"), st.just(f"/api/v1/{name}"),
        (near(templates[name]) | bodies(templates[name])).map(json_bytes),
        st.just("application/json")))
    posts = sorted(templates)
    raw_posts = st.tuples(st.just("POST"), st.sampled_from(posts + ["forward_backward"]).map(
        lambda name: f"/api/v1/{name}"), raw_bodies(), st.sampled_from(
        ["application/json", "application/x-protobuf", "text/plain"]))
    segment = (ids | st.text(min_size=1, max_size=20)).map(
        lambda s: urllib.parse.quote(s, safe=""))
    rest = st.one_of(
        st.tuples(st.just("GET"), st.builds(
            lambda a, b: "/api/v1/training_runs?" + urllib.parse.urlencode(
                {"limit": a, "offset": b}), JSON_VALUES, JSON_VALUES)),
        st.tuples(st.just("GET"), segment.map(lambda r: f"/api/v1/training_runs/{r}")),
        st.tuples(st.just("GET"), segment.map(
            lambda r: f"/api/v1/training_runs/{r}/checkpoints")),
        st.tuples(st.just("GET"), segment.map(lambda r: f"/api/v1/samplers/{r}")),
        st.tuples(st.just("DELETE"), st.builds(
            lambda r, c: f"/api/v1/training_runs/{r}/checkpoints/{c}", segment, segment)),
    ).map(lambda call: (*call, None, "application/json"))

    def datum(tokens: list[int], targets: list[int], weights: list[float]) -> Any:
        return types.Datum(model_input=types.ModelInput.from_ints(tokens),
                           loss_fn_inputs={"target_tokens": targets, "weights": weights})

    def encoded(model_id: str, seq_id: int, loss: str, data: list[Any]) -> bytes:
        request = types.ForwardBackwardRequest(
            forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss),
            model_id=model_id, seq_id=seq_id)
        return request_conv.forward_backward_request_to_proto(request).SerializeToString()

    weights = st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), max_size=8)
    data = st.lists(st.builds(datum, st.lists(int32, max_size=8), st.lists(int32, max_size=8),
                              weights), min_size=1, max_size=3)
    forward_backward = st.builds(
        encoded, st.sampled_from([live["model"]] * 4 + list(live.values())), seq,
        st.sampled_from(["cross_entropy", "importance_sampling", "ppo", "nope", ""]), data
    ).map(lambda body: ("POST", "/api/v1/forward_backward", body, "application/x-protobuf"))
    return st.one_of(json_posts, json_posts, json_posts, raw_posts, rest, forward_backward)


def test_hostile_requests_are_refused_with_a_message_and_the_service_serves_on(
        server: Server, client: Any) -> None:
    """A standing test of the door (hypothesis, derandomized, 150 calls): every call is
    answered 2xx or 4xx with a JSON `detail` — never a 5xx or a dropped connection — and a
    future one of them started ends in a result or a user error (or still waits its seq_id's
    turn); afterwards the server and its ranks and fleet serve another
    key's model as before: the same loss on the same datum, a sample."""
    from door_fuzz import FUZZ_SETTINGS, assert_refused_or_served, send
    from hypothesis import given

    training = client.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
    good = _datum([1, 2, 3, 4, 5], [1.0] * 5)
    nll = training.forward([good], "cross_entropy").result().metrics["loss:sum"]
    with server.client_with_key(FUZZ_KEY) as fuzzer:
        own = fuzzer.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
        checkpoint = own.save_weights_for_sampler("fuzz").result().path
        state = own.save_state("fuzz-state").result().path
        sampler = fuzzer.create_sampling_client(model_path=checkpoint).result()
        live = {"session": own.model_id.rsplit(":train:", 1)[0], "model": own.model_id,
                "checkpoint": checkpoint, "state": state,
                "sampler": sampler._sampling_session_id}
        headers = {"X-API-Key": FUZZ_KEY}
        seen: Counter[str] = Counter()  # what the calls met: reply statuses, futures' ends

        @FUZZ_SETTINGS
        @given(call=_fuzz_calls(live))
        def one(call: tuple[str, str, Any, str]) -> None:
            method, path, data, content_type = call
            what = f"{method} {path} {data[:300] if data else data!r}"
            reply = send(method, server.url + path, data, {**headers,
                                                            "Content-Type": content_type})
            assert_refused_or_served(reply, what, "detail")
            seen[f"{reply.status}"] += 1
            request_id = reply.body.get("request_id") if isinstance(reply.body, dict) else None
            if reply.status < 300 and request_id:  # one poll (held up to --poll-wait, 5 s)
                done = send("POST", f"{server.url}/api/v1/retrieve_future",
                            json.dumps({"request_id": request_id}).encode(),
                            {**headers, "Content-Type": "application/json"})
                assert_refused_or_served(done, f"{what}: its future", "detail")
                if isinstance(done.body, dict) and "error" in done.body:
                    assert done.body.get("category") == "user", f"{what}: {done.text[:600]}"
                    seen["future: a user error"] += 1
                else:
                    seen["future: a result or still waiting"] += 1

        one()
    print(f"hostile calls: {dict(sorted(seen.items()))}")
    # refused calls and accepted ones (measured: 134 and 16 idle, 142 and 8 on a busy machine,
    # where fewer of the models the calls create are there when the next ones come): they
    # reached past the lookups into the service
    assert sum(n for k, n in seen.items() if k.startswith("4")) >= 20, seen
    assert sum(n for k, n in seen.items() if k.startswith("2")) >= 5, seen
    assert server.process.poll() is None, server.log.read_text()[-3000:]
    assert training.forward([good], "cross_entropy").result().metrics["loss:sum"] == \
        pytest.approx(nll, rel=1e-6)
    base = client.create_sampling_client(base_model=MODEL_NAME)
    params = types.SamplingParams(max_tokens=4, temperature=0.0)
    assert base.sample(types.ModelInput.from_ints([1, 2, 3]), 1, params).result().sequences


_DROPPED_CLIENT = """
import sys, time, tinker
client = tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2])
training = client.create_lora_training_client(base_model=sys.argv[3], rank=4).result()
print(training.model_id, flush=True)
time.sleep(3600)
"""


def test_faults_a_dropped_client_and_a_restarted_server(server: Server, client: Any) -> None:
    """A client killed without closing its session: once its heartbeats stop for the session
    timeout, the server ends the session and frees its model. Meanwhile the SGLang server
    dies (SIGKILL) and tinker-serve restarts it on its address, without the adapters it had
    loaded: the next sample from an existing sampler loads them again and returns what the
    same seed drew before."""
    import psutil

    dropped = subprocess.Popen([sys.executable, "-c", _DROPPED_CLIENT, server.url, API_KEY,
                                MODEL_NAME], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "TINKER_TELEMETRY": "0"})
    try:
        assert dropped.stdout is not None
        dropped_model = dropped.stdout.readline().strip()
        assert dropped_model in server.stats()["models"]
        reaped = server.stats()["reaped_sessions"]
    finally:
        dropped.kill()
        dropped.wait(timeout=60)
    training = client.create_lora_training_client(base_model=MODEL_NAME, rank=4).result()
    training.forward_backward([_datum(list(range(30, 42)), [1.0] * 12)], "cross_entropy")
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    path = training.save_weights_for_sampler("before-restart").result().path
    sampler = client.create_sampling_client(model_path=path).result()
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=11)
    prompt = types.ModelInput.from_ints([50, 51, 52])
    before = sampler.sample(prompt, 2, params).result().sequences
    (addr,) = server.stats()["fleet"]
    port = int(addr.rpartition(":")[2])
    (victim,) = [c.pid for c in psutil.net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    started = psutil.Process(victim).create_time()
    psutil.Process(victim).kill()
    deadline = time.monotonic() + 600
    while True:  # back once a new process answers on the address
        try:
            urllib.request.urlopen(f"http://{addr}/health", timeout=5).close()
            listening = [c.pid for c in psutil.net_connections("tcp")
                         if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
            if listening and psutil.Process(listening[0]).create_time() > started:
                break
        except (OSError, psutil.Error):
            pass
        assert time.monotonic() < deadline, server.log.read_text()[-3000:]
        assert server.process.poll() is None, server.log.read_text()[-3000:]
        time.sleep(0.5)
    after = sampler.sample(prompt, 2, params).result().sequences
    assert [s.tokens for s in after] == [s.tokens for s in before]
    assert np.allclose([s.logprobs for s in after], [s.logprobs for s in before],
                       atol=PARITY_TOL)

    deadline = time.monotonic() + 10 * SESSION_TIMEOUT_S  # (the reaper checks every 5 s)
    while dropped_model in server.stats()["models"]:
        assert time.monotonic() < deadline, server.stats()
        time.sleep(0.5)
    assert server.stats()["reaped_sessions"] > reaped  # (idle clients of other tests too)


# ---- the Tinker Cookbook's own recipes, unchanged ------------------------------------------
def _cookbook_workdir(root: Path, model_dir: Path) -> Path:
    """What a user without a model hub prepares (docs/tinker.md): folders named like the
    hub ids the recipes load: the tokenizer (the model itself), No Robots and GSM8K, here
    single-digit sums in their formats (SFT teaches the answer format, with a random
    digit: the right digit is left for RL to find)."""
    from tinker_cookbook.recipes.math_rl.math_env import MathEnv

    rng = np.random.default_rng(0)
    (root / "Qwen").mkdir(parents=True)
    (root / MODEL_NAME).symlink_to(model_dir)
    chat = root / "HuggingFaceH4" / "no_robots"
    chat.mkdir(parents=True)
    with open(chat / "train.jsonl", "w") as f:
        for i in range(512):
            a, b = rng.integers(0, 5, size=2)
            messages = [{"role": "user", "content": f"What is {a} + {b}?"
                         + MathEnv.question_suffix()},
                        {"role": "assistant", "content": f"\\boxed{{{rng.integers(0, 9)}}}"}]
            f.write(json.dumps({"prompt": messages[0]["content"], "prompt_id": str(i),
                                "messages": messages, "category": "math"}) + "\n")
    gsm8k = root / "openai" / "gsm8k"
    (gsm8k / "main").mkdir(parents=True)
    for split, n in (("train", 256), ("test", 16)):
        with open(gsm8k / "main" / f"{split}.jsonl", "w") as f:
            for _ in range(n):
                a, b = rng.integers(0, 5, size=2)
                f.write(json.dumps({"question": f"What is {a} + {b}?",
                                    "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}) + "\n")
    (gsm8k / "README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n"
        "    path: main/train.jsonl\n  - split: test\n    path: main/test.jsonl\n---\n")
    return root


def _recipe(workdir: Path, server: Server, module: str, *args: str) -> list[dict[str, Any]]:
    """Run a cookbook recipe as a user would; its metrics.jsonl, one dict per step."""
    log_path = workdir / "runs" / module.rsplit(".", 1)[-1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TINKER_API_KEY": API_KEY, "TINKER_TELEMETRY": "0", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", module, f"base_url={server.url}",
                           f"log_path={log_path}", *args], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return [json.loads(line) for line in open(log_path / "metrics.jsonl")]


def test_cookbook_recipes_run_unchanged(server: Server, tiny_model_dir: Path,
                                       tmp_path: Path) -> None:
    """sl_loop learns the answer format (its loss falls); rl_basic starts from sl_loop's
    checkpoint and rl_loop from the base: both run their steps through every endpoint they
    use (samplers per step, importance-sampling steps, final checkpoints)."""
    workdir = _cookbook_workdir(tmp_path, tiny_model_dir)
    sl = _recipe(workdir, server, "tinker_cookbook.recipes.sl_loop", "batch_size=32",
                 "learning_rate=3e-3", "lora_rank=8", "save_every=0",
                 "train_on_what=last_assistant_message")
    nll = [m["train_mean_nll"] for m in sl]
    assert len(nll) == 16 and nll[-1] < 0.4 * nll[0], nll  # (measured: 6.3 -> 1.5)
    final = json.loads((workdir / "runs" / "sl_loop" / "checkpoints.jsonl")
                       .read_text().splitlines()[-1])
    rl = _recipe(workdir, server, "tinker_cookbook.recipes.rl_basic", "lora_rank=8",
                 "learning_rate=3e-4", "max_tokens=24", "max_steps=2", "save_every=0",
                 "dataset_builder=tinker_cookbook.recipes.math_rl.math_env:Gsm8kDatasetBuilder",
                 "dataset_builder.batch_size=4", "dataset_builder.group_size=4",
                 "dataset_builder.renderer_name=role_colon",
                 f"dataset_builder.model_name_for_tokenizer={MODEL_NAME}",
                 "dataset_builder.convo_prefix=None",
                 f"load_checkpoint_path={final['state_path']}")
    steps = [m for m in rl if "env/all/reward/total" in m]
    assert len(steps) == 2 and all(np.isfinite(m["env/all/reward/total"]) for m in steps)
    loop = _recipe(workdir, server, "tinker_cookbook.recipes.rl_loop", "batch_size=2",
                   "group_size=4", "max_tokens=16", "lora_rank=8", "max_steps=2",
                   "save_every=0", "loss_fn=importance_sampling")
    assert [m["progress/batch"] for m in loop if "reward/total" in m] == [0, 1]
