"""The PRM service as a real process (`python -m areal_like.rewards.prm_server`) reached by
`PRMClient` over HTTP: scores equal the model's own, and every failure (timeout, HTTP 400/500,
a killed server) is a counted RewardFailure naming the URL; past the budget the run stops."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForTokenClassification, AutoTokenizer

from areal_like.rewards.failures import RewardBudgetExceeded, RewardFailure
from areal_like.rewards.prm_client import PRMClient
from areal_like.rewards.prm_model import build_prm, step_scores
from areal_like.rewards.prm_server import PRMService

PROMPT = "<|im_start|>user\nWhat is 47 + 38?<|im_end|>\n<|im_start|>assistant\n"
STEPS = ["47 + 38: 7 + 8 = 15, write 5, carry 1; ", "4 + 3 + 1 = 8, write 8 #### 85"]


@pytest.fixture(scope="module")
def prm_dir(tmp_path_factory):
    return build_prm(tmp_path_factory.mktemp("prm"), seed=3)


@pytest.fixture(scope="module")
def service(prm_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("prm_logs") / "prm.log"
    with PRMService(prm_dir, startup_timeout=120, log_path=log) as svc:
        yield svc


async def test_scores_are_the_models_step_end_probabilities(service, prm_dir, executor_factory):
    client = PRMClient(service.url, timeout=30, executor=executor_factory())
    try:
        scores = await client.score(PROMPT, STEPS)
    finally:
        await client.close()
    model = AutoModelForTokenClassification.from_pretrained(prm_dir).eval()
    expected = step_scores(model, AutoTokenizer.from_pretrained(prm_dir), PROMPT, STEPS)
    assert len(scores) == 2 and all(0.0 < s < 1.0 for s in scores)
    assert scores == pytest.approx(expected, abs=1e-9)  # same float32 model, float64 softmax
    assert client.executor.n_calls == 1 and client.executor.n_failed == 0


async def test_bad_request_is_a_failure_naming_the_url(service, executor_factory):
    client = PRMClient(service.url, timeout=30, executor=executor_factory())
    try:
        with pytest.raises(RewardFailure, match=rf"{service.url}/score answered HTTP 400.*steps"):
            await client.score(PROMPT, ["ok; ", ""])
    finally:
        await client.close()
    assert client.executor.failures["raised"] == 1


async def test_a_stopped_server_times_out(service, executor_factory):
    client = PRMClient(service.url, timeout=0.5, executor=executor_factory())
    os.kill(service.proc.pid, signal.SIGSTOP)  # a real hang: the process stops answering
    try:
        with pytest.raises(RewardFailure, match=rf"timed out.*{service.url}/score.*prm.timeout=0.5"):
            await client.score(PROMPT, STEPS)
    finally:
        os.kill(service.proc.pid, signal.SIGCONT)
    await client.close()
    # answers again once resumed (a patient client: the resumed process may still be queued
    # for a core behind other work)
    patient = PRMClient(service.url, timeout=60, executor=client.executor)
    try:
        assert len(await patient.score(PROMPT, STEPS)) == 2
    finally:
        await patient.close()
    assert client.executor.failures["timeout"] == 1 and client.executor.n_calls == 2


async def test_non_finite_model_output_is_http_500_never_a_default(prm_dir, tmp_path,
                                                                   executor_factory):
    broken = tmp_path / "nan_prm"
    broken.mkdir()
    for f in prm_dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    weights = load_file(broken / "model.safetensors")
    weights["score.weight"] = torch.full_like(weights["score.weight"], float("nan"))
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    with PRMService(broken, startup_timeout=120) as svc:
        client = PRMClient(svc.url, timeout=30, executor=executor_factory())
        try:
            with pytest.raises(RewardFailure, match=rf"{svc.url}/score answered HTTP 500.*"
                                                    r"non-finite"):
                await client.score(PROMPT, STEPS)
        finally:
            await client.close()


async def test_killed_server_fails_then_the_budget_stops_the_run(prm_dir, executor_factory):
    svc = PRMService(prm_dir, startup_timeout=120).start()
    executor = executor_factory(max_failure_rate=0.2, failure_window=10)  # 2 failures allowed
    client = PRMClient(svc.url, timeout=5, executor=executor)
    try:
        assert len(await client.score(PROMPT, STEPS)) == 2
        svc.proc.kill()
        svc.proc.wait(timeout=30)
        for _ in range(2):
            with pytest.raises(RewardFailure, match=rf"request to {svc.url}/score failed"):
                await client.score(PROMPT, STEPS)
        with pytest.raises(RewardBudgetExceeded, match=rf"prm@127.0.0.1:{svc.port} failed 3 of "
                                                        rf"its last 4 calls.*{svc.url}/score"):
            await client.score(PROMPT, STEPS)
    finally:
        await client.close()
        svc.stop()


def test_service_start_errors_name_the_model(tmp_path):
    with pytest.raises(FileNotFoundError, match="prm.model_path=.*no config.json"):
        PRMService(tmp_path / "missing").start()
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    with pytest.raises(RuntimeError, match=r"PRM server for .*bad exited with code"):
        PRMService(bad, startup_timeout=120).start()


def test_client_rejects_bad_settings():
    with pytest.raises(ValueError, match="prm.url='127.0.0.1:1'"):
        PRMClient("127.0.0.1:1")
    with pytest.raises(ValueError, match="prm.timeout=0"):
        PRMClient("http://127.0.0.1:1", timeout=0)
