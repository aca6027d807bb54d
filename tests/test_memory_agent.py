"""Mem-alpha's pieces without a server: the per-action advantage (`action_norm`) against a
plain-loop float64 reference of the seed's formula, through PPOActor as a recipe calls it;
the action scores; the retrieval reader; the SFT demonstrations."""

from __future__ import annotations

import json
import math

import pytest
import torch
from test_algo_ref_engine import RefEngine, _batch, _model

from areal_like.algorithms import AdvantageInputs, PPOActor, get_advantage_estimator
from areal_like.algorithms.action_norm import action_spans
from areal_like.api.algorithm_presets import algorithm_config
from areal_like.data.memory_episodes import (
    MEMORY_SYSTEM,
    answer_from_memory,
    load_memory_demos,
    load_memory_episodes,
)
from areal_like.utils.stats_tracker import StatsTracker
from workflows.memory_agent import MemoryStore, _action_scores
from workflows.tool_agent import Turn
from workflows.tools import ToolCall, ToolResult

TOL = dict(rtol=1e-10, atol=1e-10)


def _memalpha_reference(rewards: list[list[float]], mask: list[list[bool]], eps: float):
    """The seed's compute_advantages: every action's reward of the step, mean and population
    std over all of them (std 1 when the variance is 0), the action's advantage on its tokens.
    Actions are found by walking each row: a run of trained tokens, reward = their sum."""
    actions = []  # (row, [positions], reward)
    for i, row in enumerate(mask):
        t = 0
        while t < len(row):
            if not row[t]:
                t += 1
                continue
            span = []
            while t < len(row) and row[t]:
                span.append(t)
                t += 1
            actions.append((i, span, sum(rewards[i][p] for p in span)))
    all_r = [r for _, _, r in actions]
    mu = sum(all_r) / len(all_r)
    var = sum((r - mu) ** 2 for r in all_r) / len(all_r)
    sigma = math.sqrt(var) if var > 0 else 1.0
    adv = [[0.0] * len(mask[0]) for _ in mask]
    for i, span, r in actions:
        for p in span:
            adv[i][p] = (r - mu) / (sigma + eps)
    return torch.tensor(adv, dtype=torch.float64)


def _agent_batch(seed: int, b: int = 5, n: int = 14):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(b, n, generator=g) > 0.4  # runs of trained tokens = actions
    mask[0] = False  # a row without actions
    rewards = torch.zeros(b, n, dtype=torch.float64)
    spans = action_spans(mask)
    for i in range(b):  # each action's reward on its last token, as the workflow places it
        for a in range(1, int(spans[i].max()) + 1):
            last = int((spans[i] == a).nonzero().max())
            rewards[i, last] = float(torch.rand((), generator=g, dtype=torch.float64)) * 3
    return rewards, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_action_norm_matches_the_seeds_formula(seed):
    rewards, mask = _agent_batch(seed)
    config = algorithm_config(adv=dict(estimator="action_norm"), norm=dict(eps=1e-8))
    out = get_advantage_estimator("action_norm")(AdvantageInputs(
        token_rewards=rewards, seq_rewards=rewards.sum(1), loss_mask=mask,
        group_index=torch.zeros(len(mask), dtype=torch.long)), config)
    want = _memalpha_reference(rewards.tolist(), mask.tolist(), 1e-8)
    torch.testing.assert_close(out.advantages, want, **TOL)
    assert out.advantages[0].abs().sum() == 0  # no actions, no advantage


def test_action_norm_of_equal_rewards_is_zero_not_a_division_by_eps():
    mask = torch.tensor([[0, 1, 1, 0, 1], [1, 1, 0, 0, 0]], dtype=torch.bool)
    rewards = torch.zeros(2, 5, dtype=torch.float64)
    rewards[0, 2] = rewards[0, 4] = rewards[1, 1] = 1.7
    out = get_advantage_estimator("action_norm")(AdvantageInputs(
        rewards, rewards.sum(1), mask, torch.zeros(2, dtype=torch.long)),
        algorithm_config(adv=dict(estimator="action_norm"), norm=dict(eps=1e-8)))
    assert out.advantages.abs().max() == 0
    torch.testing.assert_close(out.advantages,
                               _memalpha_reference(rewards.tolist(), mask.tolist(), 1e-8))


def test_action_norm_through_the_actor_trains_each_action_with_its_own_advantage(
        tiny_model_dir):
    """As recipes/agent.py calls it: dense `rewards` with r_a on each action's last token;
    the prepared batch (next-token aligned) holds the seed's advantage on every trained token
    of the action."""
    model = _model(tiny_model_dir)
    batch = _batch(model)
    loss = batch["loss_mask"].bool()
    g = torch.Generator().manual_seed(3)
    dense = torch.zeros(loss.shape, dtype=torch.float32)
    spans = action_spans(loss)
    for i in range(loss.shape[0]):
        for a in range(1, int(spans[i].max()) + 1):
            dense[i, int((spans[i] == a).nonzero().max())] = float(torch.rand((), generator=g))
    batch["rewards"] = dense
    cfg = algorithm_config(adv=dict(estimator="action_norm"), norm=dict(eps=1e-8), off_policy=dict(decoupled=False, recompute_logprob=False))
    prepared = PPOActor(RefEngine(model), cfg, tracker=StatsTracker()).compute_advantages(batch)
    # next-token alignment: position t predicts token t+1, so the masks shift left by one
    shifted_r = torch.zeros_like(dense, dtype=torch.float64)
    shifted_m = torch.zeros_like(loss)
    shifted_r[:, :-1], shifted_m[:, :-1] = dense[:, 1:].double(), loss[:, 1:]
    want = _memalpha_reference(shifted_r.tolist(), shifted_m.tolist(), 1e-8)
    torch.testing.assert_close(prepared["advantages"].double(), want, rtol=1e-6, atol=1e-6)


def _turn(*calls: tuple[str, dict, bool]) -> Turn:
    return Turn(end=0, calls=[(ToolCall(name, args), ToolResult(name, ok, None))
                              for name, args, ok in calls])


def test_action_scores_are_tool_success_and_content_quality():
    chunk = "How was your day?\nCarol: my city is Lima."
    assert _action_scores(_turn(), chunk) == (0.0, 0.0)  # no tool called: a failed action
    good = ("memory_insert", {"content": "Carol: my city is Lima."}, True)
    foreign = ("memory_insert", {"content": "Bob likes tea"}, True)  # not in the chunk
    failed = ("memory_delete", {"id": 9}, False)
    assert _action_scores(_turn(good), chunk) == (1.0, 1.0)
    assert _action_scores(_turn(good, foreign), chunk) == (1.0, 0.5)
    assert _action_scores(_turn(good, failed), chunk) == (0.5, 0.5)


async def test_memory_tools_and_the_system_prompt_agree():
    tools = MemoryStore().registry()
    for name in tools.names:  # the compact prompt of the SFT demos names every tool
        assert f"{name}(" in MEMORY_SYSTEM


def test_retrieval_reader_answers_from_the_stored_fact_only():
    q = "What is Carol's city?"
    assert answer_from_memory(["How was your day?", "Carol: my city is Lima."], q) == "lima"
    assert answer_from_memory(["How was your day?"], q) == ""  # nothing relevant stored
    assert answer_from_memory([], q) == ""
    # the latest of equally relevant entries wins (an update replaces what was known)
    assert answer_from_memory(["Carol: my city is Oslo.", "Carol: my city is Lima."], q) == "lima"


def test_demos_store_one_line_of_their_chunk():
    demos = load_memory_demos(600, seed=2)
    assert len(demos) == 600
    facts = 0
    for item in demos:
        chunk = item["messages"][1]["content"]
        body = item["target"].removeprefix("<tool_call>").removesuffix("</tool_call>")
        call = json.loads(body)
        assert call["name"] == "memory_insert" and call["arguments"]["content"] in chunk
        facts += ": my " in call["arguments"]["content"]
    assert 0.42 < facts / len(demos) < 0.58  # FACT_SHARE = 0.5 of the demos store the fact
    test_chunks = {c for e in load_memory_episodes(20, "test", 2) for c in e["chunks"]}
    shown = {item["messages"][1]["content"].split("\n", 1)[1].rsplit("\n", 1)[0]
             for item in load_memory_demos(40, split="test", seed=2)}
    assert shown == test_chunks  # the test split's demos show the test split's chunks
