"""Held-out evaluation: the pass@k estimator, and greedy accuracy / pass@k on the real fleet
against what the float64 HF model says they should be."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from conftest import SGLANG_TEST_API_KEY
from reward_fns import starts_with_any
from sglang_helpers import _reference_model, make_controller
from transformers import AutoTokenizer

from areal_like.api.io_struct import GenerationHyperparameters
from areal_like.rollout.evaluation import evaluate, pass_at_k
from workflows.rlvr import RLVRWorkflow


@pytest.mark.parametrize("n, k", [(1, 1), (4, 1), (5, 2), (6, 3), (8, 8)])
def test_pass_at_k_equals_the_share_of_k_subsets_with_a_right_sample(n, k):
    for correct in range(n + 1):
        samples = [True] * correct + [False] * (n - correct)
        subsets = list(itertools.combinations(samples, k))
        brute_force = sum(any(s) for s in subsets) / len(subsets)
        assert math.isclose(pass_at_k(n, correct, k), brute_force, rel_tol=1e-12, abs_tol=1e-15)


def test_pass_at_k_rejects_impossible_counts():
    for n, correct, k in [(4, 5, 1), (4, 1, 5), (4, 1, 0), (3, -1, 1)]:
        with pytest.raises(ValueError, match="pass_at_k needs"):
            pass_at_k(n, correct, k)


# ---- on the real fleet --------------------------------------------------------------------
N_ITEMS, N_SAMPLES, K = 128, 8, 4


def _first_chars(tokenizer) -> list[str]:
    """What each token's one-token completion starts with, as the workflow decodes it."""
    return [tokenizer.decode([t], skip_special_tokens=True)[:1] for t in range(len(tokenizer))]


@pytest.mark.sglang
def test_greedy_accuracy_and_pass_at_k_match_the_model(sglang_fleet, tiny_model_dir):
    """One-token answers, right when they start with one of a set of characters. The HF
    float64 model gives, per prompt, the greedy answer (so accuracy exactly, near-ties aside)
    and the chance p that a sample is right: pass@1 and pass@4 must lie within 4 standard
    deviations of mean(p) and mean(1 - (1 - p)^4). Repeating with the same seed repeats the
    samples exactly."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    first = _first_chars(tokenizer)
    by_char: dict[str, int] = {}
    for c in first:
        if c:
            by_char[c] = by_char.get(c, 0) + 1
    allowed, covered = "", 0  # the commonest first characters, up to ~30 % of the vocabulary
    for c, count in sorted(by_char.items(), key=lambda kv: (-kv[1], kv[0])):
        if covered + count > 0.3 * len(first):
            continue
        allowed, covered = allowed + c, covered + count
    rng = random.Random(0)
    items = [{"id": f"e{i}", "allowed": allowed,
              "messages": [{"role": "user", "content": "".join(rng.choices("abcdefgh ", k=12))}]}
             for i in range(N_ITEMS)]
    gconfig = GenerationHyperparameters(max_new_tokens=1)

    # the reference: per prompt, the chance of a right token and whether greedy is right
    workflow = RLVRWorkflow(starts_with_any, gconfig, tokenizer)
    right = torch.tensor([bool(c) and c in allowed for c in first])
    model = _reference_model(str(tiny_model_dir))
    p, greedy_right, near_ties = [], [], 0
    for item in items:
        ids = torch.tensor([workflow.prompt_ids(item)])
        with torch.no_grad():
            probs = torch.softmax(model(input_ids=ids).logits[0, -1].double(), -1)
        p.append(float(probs[right].sum()))
        top2 = probs.topk(2).values
        near_ties += int(top2[0] - top2[1] < 1e-5)
        greedy_right.append(bool(right[probs.argmax()]))
    p_t = torch.tensor(p, dtype=torch.float64)
    assert 0.1 < p_t.mean() < 0.6  # a test with room on both sides

    def run(seed: int) -> dict[str, float]:
        engine = make_controller(sglang_fleet.addresses, SGLANG_TEST_API_KEY, seed=seed)
        try:
            return evaluate(engine, items, starts_with_any, tokenizer, gconfig, pass_k=K,
                            temperature=1.0, pass_n=N_SAMPLES)
        finally:
            engine.destroy()

    result = run(seed=11)
    assert result["eval/n"] == N_ITEMS
    assert abs(result["eval/accuracy"] - sum(greedy_right) / N_ITEMS) <= near_ties / N_ITEMS
    # pass@1: a mean of N_ITEMS * N_SAMPLES independent Bernoulli(p_i) draws
    sd1 = math.sqrt(float((p_t * (1 - p_t)).sum()) / N_SAMPLES) / N_ITEMS
    assert abs(result["eval/pass@1"] - float(p_t.mean())) < 4 * sd1
    # pass@4: unbiased for 1 - (1 - p)^4 per item, with variance at most q(1 - q)
    q = 1 - (1 - p_t) ** K
    sd_k = math.sqrt(float((q * (1 - q)).sum())) / N_ITEMS
    assert abs(result[f"eval/pass@{K}"] - float(q.mean())) < 4 * sd_k
    assert result[f"eval/pass@{K}"] > result["eval/pass@1"]

    assert run(seed=11) == result  # seeded samples: the same evaluation again


def test_partial_credit_is_reward_not_accuracy():
    """reasoning-gym's scorers give partial credit ("-5" for "5" scores 0.5 on `products`):
    that is reward, not a correct answer."""
    import torch
    from tensordict import TensorDict

    from areal_like.data.reasoning_gym_tasks import load_reasoning_gym
    from areal_like.rewards import reasoning_gym_reward
    from areal_like.rollout.evaluation import episode_accuracy

    item = load_reasoning_gym("products", 20, 1)[0]
    sign_error = item["answer"][1:] if item["answer"].startswith("-") else "-" + item["answer"]
    partial = reasoning_gym_reward(item["question"], f"<answer>{sign_error}</answer>", **item)
    full = reasoning_gym_reward(item["question"], f"<answer>{item['answer']}</answer>", **item)
    assert 0 < partial < 1 and full == 1.0
    for reward, correct in ((partial, 0.0), (full, 1.0), (0.0, 0.0)):
        episode = TensorDict({"rewards": torch.tensor([[0.0, reward]])}, batch_size=[1])
        assert episode_accuracy(episode) == correct
