"""Bad input is stopped where it comes in, with an error naming the key, file or server.

Configs (a recipe YAML plus one bad override), data files, server replies (parsed, and over
real HTTP from a server that answers garbage), reward functions (run in real worker
processes) and workflow trajectories. Each case must fail within a bounded time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import sys
from pathlib import Path

import pytest
import reward_fns
import torch
from config_helpers import rollout_config
from fake_server import MisbehavingServer
from tensordict import TensorDict

from areal_like.api.config import RewardConfig
from areal_like.api.config_loader import load_config
from areal_like.api.io_struct import GenerationHyperparameters, ModelRequest
from areal_like.api.trajectory import TrajectoryError, validate_trajectory
from areal_like.data.gsm8k import load_gsm8k
from areal_like.rewards.failures import RewardFailure, RewardFunctionError
from areal_like.rewards.reward_executor import RewardExecutor
from engines.fleet.client import RemoteSGLangEngine
from engines.server.errors import InferenceServerError, ServerProtocolError
from engines.sglang.protocol import parse_generate_reply

ROOT = Path(__file__).resolve().parents[1]
BOUND_S = 120.0  # generous: these are checks, not work; a hang is what this catches


def _within(fn, *args):
    """Run fn(*args) in a thread; its exception or result, or a failure after BOUND_S."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(fn, *args)
        try:
            return future.result(timeout=BOUND_S)
        except concurrent.futures.TimeoutError:
            pytest.fail(f"no answer within {BOUND_S} s: a wait without a timeout")


def _raises(fn, *args, match: str):
    def run():
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            return e
        return None

    err = _within(run)
    assert err is not None, "accepted silently"
    assert match.lower() in str(err).lower(), f"{type(err).__name__}: {err}"
    return err


# ---- configs --------------------------------------------------------------------------

CONFIG_CASES = [
    ("server.context_length=-5", "context_length"),
    ("server.context_length=100", "context_length"),
    ("server.mem_fraction_static=0", "mem_fraction_static"),
    ("server.n_servers=0", "n_servers"),
    ("server.max_total_tokens=10", "max_total_tokens"),
    ("server.threads_per_server=0", "threads_per_server"),
    ("server.nice=-5", "nice"),
    ("rollout.controller.nice=20", "controller.nice"),
    ("server.cpus=[-1]", "cpus"),
    ("rollout.controller.cpus=[1,1]", "controller.cpus"),
    ("launcher.trainer_cpus=[0,0]", "trainer_cpus"),
    ("rollout.staleness.max_head_offpolicyness=-1", "staleness.max_head_offpolicyness"),
    ("rollout.staleness.consumer_batch_size=0", "staleness.consumer_batch_size"),
    ("rollout.client.request_timeout=0", "client.request_timeout"),
    ("rollout.health.generation_probe_timeout=0", "health.generation_probe_timeout"),
    ("rollout.server_addrs=[nohost]", "server_addrs"),
    ("rollout.staleness.queue_size=-2", "staleness.queue_size"),
    ("rollout.weights.transport=nfs", "weights.transport"),
    ("rollout.weights.bucket_mb=0", "weights.bucket_mb"),
    ("rollout.weights.group_backend=mpi", "weights.group_backend"),
    ("rollout.weights.broadcast_timeout=0", "weights.broadcast_timeout"),
    ("rollout.weights.on_broadcast_failure=ignore", "weights.on_broadcast_failure"),
    ("launcher.placement_strategy=RANDOM", "placement_strategy"),
    ("launcher.cpus_per_trainer=0", "cpus_per_trainer"),
    ("launcher.cpus_per_server=-1", "cpus_per_server"),
    ("launcher.gpus_per_trainer=-2", "gpus_per_trainer"),
    ("launcher.master_port=70000", "master_port"),
    ("launcher.ray_address=' '", "ray_address"),
    ("launcher.placement_timeout=0", "placement_timeout"),
    ("+launcher.trainer_env.MASTER_PORT=1", "trainer_env"),
    ("reward.worker_start=fork", "worker_start"),
    ("rollout.workflow=MyWorkflow", "workflow"),
    ("reward.fn=score", "fn"),
    ("train_dataset.type=my_tasks.make", "type"),
    ("algorithm.group_size=3", "group_size"),
    ("algorithm.temperature=0.5", "temperature"),
    ("algorithm.off_policy.decoupled=false", "off_policy.decoupled"),
    ("algorithm.loss.eps_clip=-0.1", "eps_clip"),
    ("algorithm.loss.top_entropy_ratio=0", "top_entropy_ratio"),
    ("algorithm.epsclip=0.2", "epsclip"),
    ("gconfig.max_new_tokens=0", "max_new_tokens"),
    ("gconfig.n_samples=0", "n_samples"),
    ("actor.optimizer.lr=-1", "lr"),
    ("actor.optimizer.beta2=1.5", "beta2"),
    ("actor.mb_spec.max_tokens_per_mb=0", "max_tokens_per_mb"),
    ("actor.collective_timeout=0", "collective_timeout"),
    ("train_dataset.batch_size=0", "batch_size"),
    ("train_dataset.type=csv", "type"),
    ("train_dataset.max_prompt_len=0", "max_prompt_len"),
    ("reward.timeout=0", "timeout"),
    ("reward.max_failure_rate=2", "max_failure_rate"),
    ("reward.on_failure=zero", "on_failure"),
    ("checkpoint.keep_last=0", "keep_last"),
    ("evaluation.n_prompts=0", "n_prompts"),
    ("total_train_steps=-1", "total_train_steps"),
]


@pytest.mark.parametrize("override,key", CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_bad_config_value_names_its_key(override, key):
    from recipes.configs import GRPOConfig

    _raises(load_config, GRPOConfig, ROOT / "recipes/conf/grpo_addition.yaml", [override],
            match=key)


# ---- what the trainer would refuse, refused by the launcher before anything starts ---------

PREFLIGHT_CASES = [
    (["algorithm.adv.estimator=grpoo"],
     "algorithm.adv.estimator='grpoo' is not registered; did you mean 'grpo'?"),
    (["algorithm.loss.policy=foo"], "algorithm.loss.policy='foo' is not registered"),
    (["algorithm.kl.coef=0.1"], "algorithm.kl.coef=0.1 is invalid: expected 0 without a reference"),
    (["train_dataset.type=gsm8k", "train_dataset.path=no/such.jsonl"],
     "train_dataset.path='no/such.jsonl': no such file"),
    (["reward.fn=no_such_module:score"], "reward.fn='no_such_module:score' cannot be imported"),
    (["rollout.workflow=no_such_module:Flow"],
     "rollout.workflow='no_such_module:Flow' cannot be imported"),
    (["valid_dataset.type=no_such_module:make"],
     "valid_dataset.type='no_such_module:make' cannot be imported"),
    (["train_dataset.type=reasoning_gym:chain_sum", "train_dataset.size=300",
      "+train_dataset.task_kwargs={min_terms:2,max_terms:2,max_digits:1}"],
     "distinct train questions in 15000 draws, fewer than size=300"),  # (the task name was
    # once taken for an import path by this check)
    (["train_dataset.size=8000"], "train_dataset (type=addition): addition task: size=8000 is "
     "too large for 2-digit train split (7244 distinct problems)"),
    (["train_dataset.type=reasoning_gym:chain_sum", "+train_dataset.task_kwargs.max_term=3"],
     "train_dataset (type=reasoning_gym:chain_sum): reasoning-gym task 'chain_sum' has no "
     "parameter 'max_term' (did you mean 'max_terms'?)"),
]


@pytest.mark.parametrize("overrides,message", PREFLIGHT_CASES,
                         ids=["estimator", "loss", "kl-no-ref", "data-file", "reward-module",
                              "workflow-module", "task-module", "rg-size", "size", "task-kwargs"])
def test_trainer_refusals_stop_the_launcher_before_any_process_starts(
        tiny_model_dir, monkeypatch, capsys, overrides, message):
    import subprocess

    from areal_like.launcher import local

    def no_process(*args, **kwargs):
        raise AssertionError(f"a process was started: {args[0] if args else kwargs}")

    monkeypatch.setattr(subprocess, "Popen", no_process)  # servers and torchrun start so
    code = local.main(["grpo", f"model.path={tiny_model_dir}", *overrides])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err


OWN_TASK = "def make_task(split, size, seed, max_terms=2, *, digits):\n    return []\n"


@pytest.mark.parametrize("overrides,message", [
    (["+train_dataset.task_kwargs.max_term=3", "+train_dataset.task_kwargs.digits=1"],
     "train_dataset: task 'my_task:make_task' has no parameter 'max_term' (did you mean "
     "'max_terms'?) (task_kwargs); its parameters: ['max_terms', 'digits']"),
    ([], "train_dataset: task 'my_task:make_task' requires ['digits'], which nothing gives"),
], ids=["typo", "missing"])
def test_a_task_of_your_own_has_its_parameters_checked_before_anything_starts(
        tiny_model_dir, tmp_path, monkeypatch, capsys, overrides, message):
    """Checked from the task function's signature, by the launcher (no process started) and
    by a recipe run by hand (exit 2 before its run folder exists)."""
    import subprocess

    from areal_like.launcher import local
    from areal_like.runtime.recipe_args import parse_recipe_args
    from recipes.configs import SFTConfig

    (tmp_path / "my_task.py").write_text(OWN_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("a process started"))
    args = [f"model.path={tiny_model_dir}", "train_dataset.type=my_task:make_task", *overrides,
            f"logging.log_dir={tmp_path / 'runs'}"]
    assert local.main(["sft", *args]) == 2
    assert message in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        parse_recipe_args(SFTConfig, "sft_addition.yaml", args)
    assert e.value.code == 2 and f"config error: {message}" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_a_name_registered_by_a_module_the_config_imports_passes_the_launchers_check(
        tmp_path, monkeypatch):
    from areal_like.algorithms import ADVANTAGE_ESTIMATORS
    from areal_like.launcher.target import resolve_target

    (tmp_path / "my_rewards.py").write_text(
        "from areal_like.algorithms import register_advantage_estimator\n"
        "from areal_like.algorithms.estimators import grpo\n"
        "register_advantage_estimator('my_grpo')(grpo)\n"
        "def score(prompt, completion, answer, **_):\n"
        "    return float(completion.strip() == answer)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        target = resolve_target("grpo", ["reward.fn=my_rewards:score",
                                         "algorithm.adv.estimator=my_grpo"])
        assert target.config.algorithm.adv.estimator == "my_grpo"
    finally:
        ADVANTAGE_ESTIMATORS.unregister("my_grpo")


# ---- data items, where they enter ------------------------------------------------------

ITEM_CASES = [
    ({"content": ""}, "train_dataset (type=my_items:make) item 1 (id q1): the prompt is empty"),
    ({"content": " \n\t"}, "item 1 (id q1): the prompt is empty"),
    ({"answer": ""}, "item 1 (id q1): answer='', which the verifier needs"),
    ({"answer": None}, "item 1 (id q1): answer=None, which the verifier needs"),
]


@pytest.mark.parametrize("change,message", ITEM_CASES,
                         ids=["empty-prompt", "blank-prompt", "empty-answer", "null-answer"])
def test_items_a_run_cannot_use_are_refused_naming_task_and_index(tmp_path, monkeypatch,
                                                                  change, message):
    """A user task's items (no file: the task builds them), checked against the default
    verifier (exact match, which needs `answer`)."""
    from areal_like.api.config import DatasetConfig
    from areal_like.data.tasks import build_task

    bad = {"id": "q1", "content": "What is 1 + 1?", "answer": "2"} | change
    (tmp_path / "my_items.py").write_text(
        "from areal_like.rewards import exact_match_reward\n"
        "from areal_like.data.tasks import Task\n"
        "from datasets import Dataset\n"
        f"ROWS = [('q0', 'What is 2 + 2?', '4'), ({bad['id']!r}, {bad['content']!r}, "
        f"{bad['answer']!r})]\n"
        "def make(split, size, seed):\n"
        "    items = [{'id': i, 'messages': [{'role': 'user', 'content': c}], 'answer': a}\n"
        "             for i, c, a in ROWS]\n"
        "    return Task(Dataset.from_list(items), exact_match_reward)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_items", raising=False)  # each case's own
    config = DatasetConfig(type="my_items:make", size=2)
    _raises(build_task, config, "", "train_dataset", match=message)


def test_a_prompt_that_tokenizes_to_nothing_is_refused(tiny_model_dir):
    """A real tokenizer whose normalizer drops zero-width spaces (as some do): the text is
    not blank to Python, but the model would get no prompt token."""
    from datasets import Dataset
    from tokenizers import normalizers

    from areal_like.api.config import DatasetConfig, ModelConfig
    from areal_like.data.prompt_limits import limit_prompt_length, load_tokenizer

    tokenizer = load_tokenizer(ModelConfig(path=str(tiny_model_dir)))
    tokenizer.backend_tokenizer.normalizer = normalizers.Replace("\u200b", "")
    items = Dataset.from_list([{"messages": [{"role": "user", "content": c}]}
                               for c in ("What is 1 + 1?", "\u200b\u200b")])
    _raises(limit_prompt_length, items, tokenizer, DatasetConfig(), "valid_dataset",
            match=r"valid_dataset (type=addition) item 1: the prompt '\u200b\u200b' tokenizes "
                  "to nothing")


# ---- data files -----------------------------------------------------------------------

DATA_CASES = [
    ("", "empty"),
    ('{"question": "q", "answer": "#### 1"}\n{"question": "q2", "answer": \n', "data.jsonl:2"),
    ('{"question": "q"}\n', "data.jsonl:1: key 'answer' is missing"),
    ('{"question": null, "answer": "#### 1"}\n', "data.jsonl:1: key 'question' is null"),
    ('{"question": "q", "answer": "no marker"}\n', "data.jsonl:1: key 'answer'"),
    ('["q", "#### 1"]\n', "data.jsonl:1"),
    ('{"question": "", "answer": "#### 1"}\n', "data.jsonl:1: key 'question'"),
    ('{"question": 7, "answer": "#### 1"}\n', "data.jsonl:1: key 'question'"),
]


@pytest.mark.parametrize("text,message", DATA_CASES,
                         ids=["empty", "truncated", "missing", "null", "marker", "not-object",
                              "blank", "not-string"])
def test_bad_data_file_names_file_line_and_key(tmp_path, text, message):
    path = tmp_path / "data.jsonl"
    path.write_text(text)
    _raises(load_gsm8k, path, match=message)


# ---- server replies -------------------------------------------------------------------

def _reply(**changes):
    reply = {"output_ids": [5, 6],
             "meta_info": {"output_token_logprobs": [[-0.5, 5, None], [-1.0, 6, None]],
                           "finish_reason": {"type": "stop"}, "weight_version": "3"}}
    for key, value in changes.items():
        if key == "output_ids":
            reply["output_ids"] = value
        else:
            reply["meta_info"][key] = value
    return reply


REPLY_CASES = [
    ("positive-logprob", _reply(output_token_logprobs=[[7.0, 5, None], [-1.0, 6, None]]),
     "log-probability 7.0"),
    ("nan-logprob", _reply(output_token_logprobs=[[math.nan, 5, None], [-1.0, 6, None]]),
     "log-probability nan"),
    ("inf-logprob", _reply(output_token_logprobs=[[-1.0, 5, None], [math.inf, 6, None]]),
     "log-probability inf"),
    ("text-logprob", _reply(output_token_logprobs=[["abc", 5, None], [-1.0, 6, None]]),
     "log-probability 'abc'"),
    ("too-few-logprobs", _reply(output_token_logprobs=[[-1.0, 5, None]]),
     "1 entries for 2 output tokens"),
    ("wrong-token", _reply(output_token_logprobs=[[-1.0, 9, None], [-1.0, 6, None]]),
     "for token 9"),
    ("bad-finish", _reply(finish_reason={"type": "exploded"}), "finish_reason"),
    ("bad-spans", _reply(weight_versions=[{"version": "1", "start": 0, "end": 1}]),
     "weight_versions"),
    ("bad-version", _reply(weight_version="v1"), "weight version 'v1'"),
    ("negative-id", _reply(output_ids=[-5, 6]), "output_ids"),
    ("no-meta", {"output_ids": [5]}, "meta_info"),
]


@pytest.mark.parametrize("reply,message", [c[1:] for c in REPLY_CASES],
                         ids=[c[0] for c in REPLY_CASES])
def test_bad_server_reply_names_the_server(reply, message):
    err = _raises(parse_generate_reply, reply, "10.0.0.7:30000", match=message)
    assert isinstance(err, ServerProtocolError) and "10.0.0.7:30000" in str(err)


@pytest.mark.parametrize("body", ["<html>502 bad gateway</html>",
                                  json.dumps(_reply())[:40]], ids=["garbage", "truncated"])
def test_malformed_json_is_retried_then_names_server_and_endpoint(body):
    server = MisbehavingServer("body", body)
    addr = f"127.0.0.1:{server.port}"
    engine = RemoteSGLangEngine(rollout_config(server_addrs=[addr], request_retries=3,
                                              retry_backoff=0.01, request_timeout=30))
    try:
        engine.initialize()
        req = ModelRequest(input_ids=[1, 2, 3], gconfig=GenerationHyperparameters())
        err = _raises(lambda: asyncio.run(engine.agenerate(req)), match=addr)
        assert isinstance(err, InferenceServerError)
        assert "/generate" in str(err) and "not valid JSON" in str(err)
        assert body[:20] in str(err)
        assert server.requests == 3  # retried before giving up
    finally:
        engine.destroy()
        server.stop()


# ---- reward functions -----------------------------------------------------------------

@pytest.fixture(scope="module")
def rewards():
    executor = RewardExecutor(RewardConfig(max_workers=1, max_failure_rate=1.0, timeout=60))
    yield executor
    executor.shutdown()


@pytest.mark.parametrize("value,detail", [(True, "bool"), ("1.0", "str"), (math.inf, "inf"),
                                          (None, "None"), (math.nan, "nan"),
                                          ([1.0], "list")],
                         ids=["bool", "str", "inf", "none", "nan", "list"])
def test_invalid_reward_value_is_a_failed_sample_naming_the_function(rewards, value, detail):
    async def call():
        return await rewards(reward_fns.returns, "p", "c", value=value)

    err = _raises(lambda: asyncio.run(call()), match="returns")
    assert isinstance(err, RewardFailure) and err.kind == "invalid"
    assert detail.lower() in str(err).lower()


def _closure_reward():
    answer = "42"

    def reward(prompt, completion, **_):
        return float(completion == answer)

    return reward


def _one_argument(completion):
    return 1.0


@pytest.mark.parametrize("fn,name", [(lambda p, c, **_: 1.0, "<lambda>"),
                                     (_closure_reward(), "reward"),
                                     (_one_argument, "_one_argument")],
                         ids=["lambda", "closure", "signature"])
def test_reward_function_that_cannot_run_is_reported_at_startup(rewards, fn, name):
    err = _raises(rewards.check, fn, {"answer": "1"}, match=name)
    assert isinstance(err, RewardFunctionError)


# ---- trajectories -----------------------------------------------------------------------

def _trajectory(**changes):
    td = TensorDict({"input_ids": torch.tensor([[1, 2, 3]]),
                     "attention_mask": torch.ones(1, 3, dtype=torch.long),
                     "loss_mask": torch.tensor([[0, 1, 1]]),
                     "logprobs": torch.tensor([[0.0, -0.5, -0.2]]),
                     "versions": torch.tensor([[-1, 0, 0]]),
                     "rewards": torch.tensor([1.0])}, batch_size=[1])
    for key, value in changes.items():
        td[key] = value
    return td


TRAJECTORY_CASES = [
    ("empty", TensorDict({k: torch.zeros(0, 3, dtype=torch.long if k != "logprobs"
                                         else torch.float32)
                          for k in ("input_ids", "attention_mask", "loss_mask", "logprobs",
                                    "versions")} | {"rewards": torch.zeros(0)},
                         batch_size=[0]), "empty"),
    ("inf-reward", _trajectory(rewards=torch.tensor([math.inf])), "'rewards'"),
    ("nan-logprob", _trajectory(logprobs=torch.tensor([[0.0, math.nan, -0.2]])), "'logprobs'"),
    ("no-tokens", _trajectory(attention_mask=torch.zeros(1, 3, dtype=torch.long),
                              loss_mask=torch.zeros(1, 3, dtype=torch.long)), "no token"),
]


@pytest.mark.parametrize("td,message", [c[1:] for c in TRAJECTORY_CASES],
                         ids=[c[0] for c in TRAJECTORY_CASES])
def test_bad_trajectory_is_rejected_naming_the_key(td, message):
    err = _raises(validate_trajectory, td, match=message)
    assert isinstance(err, TrajectoryError)
