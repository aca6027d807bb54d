"""Workflows and the executor against real SGLang servers (tiny 1m model)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import SGLANG_TEST_API_KEY
from prefix_parity import assert_tree_parity
from sglang_helpers import fleet_version, make_controller
from transformers import AutoTokenizer

from areal_like.api import GenerationHyperparameters, ModelRequest, WeightUpdateMeta
from areal_like.api.config import RewardConfig
from areal_like.api.errors import RolloutTimeoutError, RolloutWorkflowError
from areal_like.api.trajectory import validate_trajectory
from areal_like.data.memory_episodes import answer_from_memory
from areal_like.rewards import exact_match_reward
from areal_like.rewards.reward_executor import RewardExecutor
from areal_like.rollout.controller import RolloutController
from areal_like.utils.batching import concat_padded
from engines.fleet.client import RemoteSGLangEngine
from workflows import (
    MemoryAgentWorkflow,
    MultiTurnWorkflow,
    ReMaxWorkflow,
    RLVRWorkflow,
    ToolAgentWorkflow,
    ToolRegistry,
    make_memory_episodes,
    parse_tool_calls,
)
from workflows.common import stable_id
from workflows.memory_agent import MemoryStore, content_validity

pytestmark = pytest.mark.sglang
GCONFIG = GenerationHyperparameters(n_samples=4, max_new_tokens=6, temperature=1.0)
ITEMS = [{"id": f"q{i}", "messages": [{"role": "user", "content": f"What is {i} + {i}?"}],
          "answer": str(2 * i)} for i in range(12)]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def rewards() -> Iterator[RewardExecutor]:
    executor = RewardExecutor(RewardConfig(use_processes=False))
    yield executor
    executor.shutdown()


def _engine(fleet, **config) -> RolloutController:
    engine = make_controller(fleet.addresses, SGLANG_TEST_API_KEY, **config)
    engine.set_version(fleet_version(fleet.addresses, SGLANG_TEST_API_KEY))
    return engine


@pytest.fixture
def engine(sglang_fleet) -> Iterator[RolloutController]:
    engine = _engine(sglang_fleet, consumer_batch_size=2, max_concurrent_rollouts=8)
    yield engine
    engine.destroy()


def _bump(engine: RemoteSGLangEngine, model_dir: Path) -> int:
    """A weight update to the same weights under the next version label."""
    version = engine.get_version() + 1
    engine.update_weights(WeightUpdateMeta.from_disk(str(model_dir), version))
    return version


def test_rlvr_batch_layout(engine, tokenizer, rewards):
    workflow = RLVRWorkflow(exact_match_reward, GCONFIG, tokenizer, rewards)
    batch = engine.rollout_batch(ITEMS[:3], workflow)
    validate_trajectory(batch)
    assert batch.batch_size[0] == 3 * GCONFIG.n_samples
    group_ids = batch["group_id"].view(3, GCONFIG.n_samples)
    assert (group_ids == group_ids[:, :1]).all() and group_ids[:, 0].unique().numel() == 3
    version = engine.get_version()
    for row in range(batch.batch_size[0]):
        attn, loss = batch["attention_mask"][row].bool(), batch["loss_mask"][row].bool()
        n_prompt = int((attn & ~loss).sum())
        prompt = tokenizer.apply_chat_template(ITEMS[row // GCONFIG.n_samples]["messages"],
                                               tokenize=False, add_generation_prompt=True)
        assert batch["input_ids"][row, :n_prompt].tolist() == tokenizer.encode(prompt)
        assert (batch["versions"][row][loss] == version).all()
        assert (batch["versions"][row][~loss] == -1).all()
        assert (batch["logprobs"][row][loss] <= 0).all() and loss.sum() >= 1
    assert set(batch["rewards"].tolist()) <= {0.0, 1.0}


def test_remax_rewards_and_greedy_baseline(engine, tokenizer, rewards):
    def length_reward(prompt, completion, **_):  # distinguishes greedy from samples
        return float(len(completion))

    workflow = ReMaxWorkflow(length_reward, GCONFIG.new(n_samples=3), tokenizer, rewards)
    batch = engine.rollout_batch(ITEMS[:2], workflow)
    validate_trajectory(batch)
    assert batch.batch_size[0] == 6
    for row in range(6):  # each sample's own reward, recomputed from its tokens
        generated = batch["input_ids"][row][batch["loss_mask"][row].bool()].tolist()
        text = tokenizer.decode(generated, skip_special_tokens=True)
        assert float(batch["rewards"][row]) == float(len(text))
    greedy = batch["baseline_rewards"].view(2, 3)
    assert (greedy == greedy[:, :1]).all()  # one greedy baseline per prompt
    for i, item in enumerate(ITEMS[:2]):  # the baseline is the greedy completion's reward
        ids = workflow.prompt_ids(item)
        resp = engine.executor.run_coroutine(engine.agenerate(ModelRequest(
            input_ids=ids, gconfig=workflow.gconfig.new(n_samples=1, greedy=True))), 60)
        text = tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
        assert float(greedy[i, 0]) == float(len(text))


@pytest.mark.parametrize("eta", [0, 2])
def test_staleness_bound_with_weight_updates(sglang_fleet, tiny_model_dir, tokenizer, rewards, eta):
    engine = _engine(sglang_fleet, consumer_batch_size=2, max_concurrent_rollouts=8,
                     max_head_offpolicyness=eta)
    try:
        workflow = RLVRWorkflow(exact_match_reward, GCONFIG.new(n_samples=2), tokenizer, rewards)
        loader = [ITEMS[i:i + 2] for i in range(0, len(ITEMS), 2)]
        seen_lags = set()
        for _ in range(4):
            batch = engine.prepare_batch(loader, workflow)
            version = engine.get_version()
            loss = batch["loss_mask"].bool()
            lags = version - batch["versions"][loss]
            assert (lags >= 0).all() and (lags <= eta).all(), (version, lags.unique())
            seen_lags |= set(lags.unique().tolist())
            _bump(engine, tiny_model_dir)
        if eta == 0:
            assert seen_lags == {0}
        stats = engine.executor.stats()
        assert stats["accepted"] >= 8
    finally:
        engine.destroy()


def test_workflow_exception_surfaces_in_wait(engine, tokenizer, rewards):
    class Exploding(RLVRWorkflow):
        async def arun_episode(self, eng, data):
            await eng.agenerate(ModelRequest(input_ids=self.prompt_ids(data),
                                             gconfig=self.gconfig.new(n_samples=1)))
            raise ZeroDivisionError(f"bad item {data['id']}")

    engine.submit(ITEMS[5], Exploding(exact_match_reward, GCONFIG, tokenizer, rewards))
    with pytest.raises(RolloutWorkflowError, match="q5") as info:
        engine.wait(1, timeout=60)
    assert isinstance(info.value.__cause__, ZeroDivisionError)


@pytest.mark.e2e  # waits out its 20 s timeout: the quick tier leaves it out
def test_always_rejecting_filter_times_out_clearly(engine, tokenizer, rewards):
    workflow = RLVRWorkflow(exact_match_reward, GCONFIG.new(n_samples=1), tokenizer, rewards)
    for item in ITEMS[:3]:
        engine.executor.submit(item, workflow, should_accept=lambda td: False)
    deadline = time.monotonic() + 120  # the three episodes' work, however slow the machine
    while engine.executor.stats()["rejected"] < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(RolloutTimeoutError, match=r"rejected 3") as info:
        engine.wait(1, timeout=1)  # all three rejected: nothing can arrive
    assert "should_accept" in str(info.value)


class RecordingEngine:
    """Forwards to the real engine and records every (sent ids, generated ids) pair."""

    def __init__(self, inner: RemoteSGLangEngine) -> None:
        self.inner, self.exchanges = inner, []

    async def agenerate(self, req):
        resp = await self.inner.agenerate(req)
        self.exchanges.append((list(req.input_ids), list(resp.output_tokens)))
        return resp


async def test_multi_turn_tokens_are_the_exact_concatenation(engine, tokenizer, rewards):
    workflow = MultiTurnWorkflow(exact_match_reward, GCONFIG.new(max_new_tokens=4), tokenizer,
                                 max_turns=3, turn_discount=0.5, reward_executor=rewards)
    recorder = RecordingEngine(engine)
    item = {"id": "mt", "messages": [{"role": "user", "content": "What is 12 + 30?"}],
            "answer": "definitely not generated"}
    td = await workflow.arun_episode(recorder, item)
    validate_trajectory(td)
    assert len(recorder.exchanges) == 3 and int(td["num_turns"]) == 3
    ids = td["input_ids"][0].tolist()
    last_sent, last_out = recorder.exchanges[-1]
    assert ids == last_sent + last_out
    for (sent, out), (next_sent, _) in zip(recorder.exchanges, recorder.exchanges[1:], strict=False):
        assert next_sent[: len(sent) + len(out)] == sent + out  # history never re-tokenized
    generated = [t for _, out in recorder.exchanges for t in out]
    assert [t for t, m in zip(ids, td["loss_mask"][0].tolist(), strict=True) if m] == generated
    assert float(td["rewards"]) == 0.0


async def test_tool_agent_with_scripted_call(engine, tokenizer, rewards, tiny_model_dir):
    tools = ToolRegistry()

    @tools.register
    async def add(a: int, b: int) -> int:
        """a + b"""
        return a + b

    workflow = ToolAgentWorkflow(tools, exact_match_reward, GCONFIG.new(max_new_tokens=8),
                                 tokenizer, max_steps=2, action_reward_weight=0.5,
                                 reward_executor=rewards)
    call = '<tool_call>{"name": "add", "arguments": {"a": 20, "b": 22}}</tool_call>'
    item = {"id": "agent", "messages": [{"role": "user", "content": "What is 20 + 22?"}],
            "answer": "42", "scripted_actions": [call]}
    td = await workflow.arun_episode(engine, item)
    validate_trajectory(td)
    text = tokenizer.decode(td["input_ids"][0])
    assert call in text and '"result": 42' in text
    assert int(td["num_actions"]) >= 1
    dense = td["action_rewards"][0]
    assert dense[dense != 0].tolist()[:1] == [0.5]  # the scripted call succeeded
    loss = td["loss_mask"][0].bool()
    first_trained = int(loss.nonzero()[0])
    assert "tool" in tokenizer.decode(td["input_ids"][0, :first_trained])  # result came first
    assert float(td["rewards"]) == pytest.approx(float(td["outcome_rewards"]) + dense.sum().item())
    # a group of such episodes (the prompt, the call and its result shared, the answers
    # sampled) through the trainer's prefix tree: what the packed whole computes
    group = concat_padded([td, *[await workflow.arun_episode(engine, item) for _ in range(2)]])
    tokens, rows = assert_tree_parity(tiny_model_dir, group)
    assert rows < 0.6 * tokens


async def test_memory_agent_episode(engine, tokenizer, rewards, tiny_model_dir):
    """Mem-alpha's rollouts against a real server: n rollouts of one item, one row per chunk
    conversation, each action's reward r1 + r2 + beta*r3 + gamma*r4 on its last token —
    recomputed here by replaying each rollout's actions (a scripted fact, then what the model
    generated) into a fresh memory."""
    episode = make_memory_episodes(1, seed=3, n_chunks=2)[0]
    fact = next(line for line in episode["chunks"][0].splitlines() if ": my " in line)
    insert = json.dumps({"name": "memory_insert", "arguments": {"content": fact}})
    episode["scripted_actions"] = [f"<tool_call>{insert}</tool_call>"]
    workflow = MemoryAgentWorkflow(GCONFIG.new(max_new_tokens=24, n_samples=2), tokenizer,
                                   max_steps=1, beta=0.05, gamma=0.1, reward_executor=rewards)
    td = await workflow.arun_episode(engine, episode)
    validate_trajectory(td)
    assert td.batch_size[0] == 2 * 2  # two rollouts x two chunk conversations
    assert (td["group_id"] == td["group_id"][0]).all()
    assert td["rollout_id"].tolist() == [0, 0, 1, 1]
    source_len = sum(len(c) for c in episode["chunks"])
    for k in range(2):
        memory = MemoryStore()
        tools = memory.registry()
        await tools.call(parse_tool_calls(episode["scripted_actions"][0])[0])
        scores = []
        for i, chunk in enumerate(episode["chunks"]):
            row = 2 * k + i
            trained = td["loss_mask"][row].bool()
            assert int(td["num_actions"][row]) == 1  # max_steps=1: one generated turn
            text = tokenizer.decode(td["input_ids"][row][trained].tolist(),
                                    skip_special_tokens=True)
            calls = parse_tool_calls(text)
            results = [await tools.call(c) for c in calls]
            ok = [r.ok for r in results]
            valid = [r.ok and content_validity(c, chunk) == 1.0
                     for c, r in zip(calls, results, strict=True)]
            scores.append((sum(ok) / len(ok), sum(valid) / len(valid)) if calls else (0, 0))
        got = [answer_from_memory([memory.entries[j] for j in sorted(memory.entries)], q)
               for q in episode["questions"]]
        r1 = sum(a == b.lower() for a, b in zip(got, episode["answers"], strict=True)) / 2
        assert r1 >= 0.5  # the scripted fact answers the first question
        r3 = max(0.0, 1 - len(memory.render()) / source_len)
        for i, (r2, r4) in enumerate(scores):
            row = 2 * k + i
            dense = td["action_rewards"][row]
            last_trained = int(td["loss_mask"][row].bool().nonzero().max())
            assert dense.nonzero().flatten().tolist() == [last_trained]  # on the action's end
            assert float(dense[last_trained]) == pytest.approx(
                r1 + r2 + 0.05 * r3 + 0.1 * r4, abs=1e-6)
            assert float(td["accuracy"][row]) == r1
            assert float(td["compression"][row]) == pytest.approx(r3, abs=1e-6)
        want_mean = sum(r1 + r2 + 0.05 * r3 + 0.1 * r4 for r2, r4 in scores) / 2
        assert float(td["mean_reward"][2 * k]) == pytest.approx(want_mean, abs=1e-6)
    answers_turn = tokenizer.decode(td["input_ids"][1])
    assert fact not in answers_turn  # chunk 2's prompt does not carry chunk 1's text
    # the rollouts' conversations (system prompt and chunk shared) through the prefix tree
    tokens, rows = assert_tree_parity(tiny_model_dir, td)
    assert rows < 0.7 * tokens


def test_executor_state_survives_round_trip(sglang_fleet, tokenizer, rewards, tmp_path):
    """A restored executor continues from what the checkpoint held: its next batch comes from
    the buffered groups and the items in flight at the save, never from consumed ones. (Which
    of those finish first is timing; exact resume at eta > 0 is not promised here.)"""
    workflow = RLVRWorkflow(exact_match_reward, GCONFIG.new(n_samples=2), tokenizer, rewards)
    loader = [ITEMS[i:i + 2] for i in range(0, len(ITEMS), 2)]
    first = _engine(sglang_fleet, consumer_batch_size=2, max_head_offpolicyness=1)
    try:
        consumed = set(first.prepare_batch(loader, workflow)["group_id"].tolist())
        state = first.executor.state_dict()
        torch.save(state, tmp_path / "executor.pt")
        expected = set(first.prepare_batch(loader, workflow)["group_id"].tolist())
    finally:
        first.destroy()
    held = {stable_id(b["data_id"]) for b in state["buffered"]}
    held |= {stable_id(d["id"]) for d in state["pending_data"]}
    second = _engine(sglang_fleet, consumer_batch_size=2, max_head_offpolicyness=1)
    try:
        second.executor.load_state_dict(torch.load(tmp_path / "executor.pt", weights_only=True))
        resumed = set(second.prepare_batch(loader, workflow)["group_id"].tolist())
    finally:
        second.destroy()
    assert len(resumed) == len(expected) == 2 and len(held) >= 2
    assert expected <= held and resumed <= held and not resumed & consumed
