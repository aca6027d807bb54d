"""On-policy distillation against real SGLang servers: the student samples on one server, the
teacher (another server serving other weights) scores every sampled token; its log-probs are
checked against a float64 HF forward of the teacher's weights, and the advantages the actor
makes of them against a float64 reference. A dead teacher fails its samples under the reward
rules (excluded, counted, budgeted), never as a 0.0 reward."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from conftest import SGLANG_TEST_API_KEY
from reward_fns import starts_with_any
from sglang_helpers import (
    LOGPROB_ATOL,
    fleet_version,
    hf_logprobs,
    hf_next_token_logprobs,
    make_engine,
    perturbed_copy,
    restore_session_fleet,
)
from test_train_inference_gap import _load_on

from areal_like.api.io_struct import GenerationHyperparameters
from areal_like.api.reward_config import RewardConfig
from areal_like.rewards.failures import GroupRewardFailure, RewardBudgetExceeded
from areal_like.rewards.reward_executor import RewardExecutor
from recipes.configs import DistillConfig, TeacherConfig
from workflows.distill import DistillWorkflow, TeacherScorer

DATA = {"messages": [{"role": "user", "content": "what is 3 + 4"}], "allowed": "0123456789",
        "id": "q1"}


def _workflow(model_dir: Path, teacher: TeacherScorer, executor: RewardExecutor,
              n: int = 3, use_task_reward: bool = True) -> DistillWorkflow:
    g = GenerationHyperparameters(max_new_tokens=10, temperature=1.0, n_samples=n)
    return DistillWorkflow(starts_with_any, g, str(model_dir), teacher,
                           use_task_reward=use_task_reward, reward_executor=executor)


@pytest.mark.sglang
async def test_the_teacher_scores_the_students_tokens(sglang_fleet, tiny_model_dir, tmp_path):
    student_addr, teacher_addr = sglang_fleet.addresses
    version = fleet_version(sglang_fleet.addresses, SGLANG_TEST_API_KEY)
    teacher_dir = perturbed_copy(tiny_model_dir, tmp_path / "teacher", seed=5, scale=0.1)
    student = make_engine([student_addr], SGLANG_TEST_API_KEY)
    student.set_version(version)
    executor = RewardExecutor(RewardConfig(use_processes=False))
    scorer = TeacherScorer(functools.partial(make_engine, [teacher_addr], SGLANG_TEST_API_KEY),
                           timeout=60, top_k=3)
    try:
        _load_on(teacher_addr, teacher_dir, version)
        group = await _workflow(tiny_model_dir, scorer, executor).arun_episode(student, DATA)
        alone = await _workflow(tiny_model_dir, scorer, executor,
                                use_task_reward=False).arun_episode(student, DATA)
    finally:
        scorer.close()
        student.destroy()
        executor.shutdown()
        restore_session_fleet(sglang_fleet, tiny_model_dir)

    assert group.shape[0] == 3 and group["teacher_logprobs"].shape == group["input_ids"].shape
    kls = []
    for row in range(3):
        mask = group["loss_mask"][row].bool()
        ids = group["input_ids"][row][group["attention_mask"][row].bool()].tolist()
        start = int(mask.nonzero()[0])
        prompt, output = ids[:start], ids[start:]
        teacher = hf_logprobs(teacher_dir, prompt, output)  # independent float64 forward
        torch.testing.assert_close(group["teacher_logprobs"][row][mask].double(), teacher,
                                   atol=LOGPROB_ATOL, rtol=0)
        assert (group["teacher_logprobs"][row][~mask] == 0).all()  # nothing on the prompt
        # top-3: the teacher's distribution of each completion token, token-aligned
        full = hf_next_token_logprobs(teacher_dir, prompt, output)
        top_ids = group["teacher_top_ids"][row][mask]
        torch.testing.assert_close(group["teacher_top_logprobs"][row][mask].double(),
                                   full.gather(-1, top_ids), atol=LOGPROB_ATOL, rtol=0)
        kth = full.topk(3, dim=-1).values[:, -1]
        assert (group["teacher_top_logprobs"][row][mask][:, -1] >= kth - LOGPROB_ATOL).all()
        assert (group["teacher_top_ids"][row][~mask] == 0).all()
        completion = _completion_text(tiny_model_dir, output)
        assert float(group["rewards"][row]) == starts_with_any("", completion,
                                                               allowed=DATA["allowed"])
        kls.append(float((group["logprobs"][row][mask].double() - teacher).mean()))
    # other weights: the teacher's log-probs are not the student's own
    assert max(abs(k) for k in kls) > 0.05
    # the teacher alone (`teacher.use_task_reward=false`): the verifier is never called, every
    # row's task reward is 0.0 (GRPO's advantage then 0), the teacher's columns are all there
    assert alone["rewards"].tolist() == [0.0] * 3
    alone_mask = alone["loss_mask"].bool()
    scored = alone["teacher_logprobs"][alone_mask]
    assert torch.isfinite(scored).all() and (scored <= 0).all() and (scored < 0).any()
    assert alone["teacher_top_ids"].shape == (*alone["input_ids"].shape, 3)
    # the verifier's and the teacher's calls, all counted: 3 + 3, then the teacher's 3
    assert executor.n_calls == 3 + 3 + 3


@pytest.mark.parametrize("kl_discount", [None, 0.0, 0.5])
def test_the_teacher_is_the_kl_reference_of_the_update(kl_discount):
    """What the recipe gives the actor: per-token reward -coef x (log p_old - log p_teacher)
    as a return (kl.discount None: summed; 0: each token's own; 0.5: discounted), beside
    GRPO's task advantage (float64 reference written here)."""
    from tensordict import TensorDict

    from areal_like.algorithms import PPOActor
    from areal_like.algorithms.functional import shift_to_next_token
    from areal_like.api.algorithm_presets import algorithm_preset
    from areal_like.utils.stats_tracker import StatsTracker

    gen = torch.Generator().manual_seed(0)
    b, length, prompt = 4, 9, 3
    loss_mask = torch.zeros(b, length, dtype=torch.bool)
    loss_mask[:, prompt:] = True
    loss_mask[1, 7:] = False  # a shorter completion (padding after it)
    attn = loss_mask.clone()
    attn[:, :prompt] = True
    behav = torch.where(loss_mask, -torch.rand(b, length, generator=gen), 0.0)
    teacher = torch.where(loss_mask, -torch.rand(b, length, generator=gen), 0.0)
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    batch = TensorDict({"input_ids": torch.randint(3, 50, (b, length), generator=gen),
                        "attention_mask": attn, "loss_mask": loss_mask, "logprobs": behav,
                        "versions": torch.zeros(b, length, dtype=torch.long),
                        "rewards": rewards, "group_id": torch.zeros(b, dtype=torch.long),
                        "teacher_logprobs": teacher}, batch_size=[b])
    batch["ref_logp"] = shift_to_next_token(batch["teacher_logprobs"])
    coef = 0.5
    config = algorithm_preset("distill", group_size=4, kl={"coef": coef, "discount": kl_discount},
                              off_policy={"decoupled": False, "recompute_logprob": False})
    out = PPOActor(_NoEngine(), config, ref_in_batch=True,
                   tracker=StatsTracker()).compute_advantages(batch)

    r = rewards.double()
    task = (r - r.mean()) / (r.std(unbiased=False) + config.norm.eps)
    mask = shift_to_next_token(loss_mask).bool()
    kl = torch.where(mask, shift_to_next_token(behav).double()
                     - shift_to_next_token(teacher).double(), 0.0)
    gamma = 1.0 if kl_discount is None else kl_discount
    to_go = torch.zeros_like(kl)  # sum over t' >= t of gamma^(t' - t) kl_t', trained t' only
    for i in range(b):
        later = 0.0
        for t in reversed(range(kl.shape[1])):
            if mask[i, t]:
                later = kl[i, t].item() + gamma * later
                to_go[i, t] = later
    expected = torch.where(mask, task[:, None] - coef * to_go, 0.0)
    torch.testing.assert_close(out["advantages"].double(), expected, atol=1e-6, rtol=0)


def test_distill_full_loss_is_the_exact_reverse_kl_to_the_teachers_top_k():
    """`distill_full`: the loss adds, at every trained position, coef x KL(pi || teacher) over
    the vocabulary (teacher known on its top k, the rest spread evenly) to the PPO term;
    checked through the engine's packing against a float64 reference written here, with
    NaN and out-of-vocabulary ids where nothing is trained and an empty completion."""
    from tensordict import TensorDict

    from areal_like.algorithms import PPOActor
    from areal_like.algorithms.actors.loss_fns import make_policy_loss_fn
    from areal_like.algorithms.functional import shift_to_next_token
    from areal_like.api.algorithm_presets import algorithm_preset
    from areal_like.utils.stats_tracker import StatsTracker
    from engines.fsdp.packing import pack_sequences

    gen = torch.Generator().manual_seed(1)
    b, length, prompt, n_vocab, k, coef = 3, 7, 2, 11, 4, 0.7
    loss_mask = torch.zeros(b, length, dtype=torch.bool)
    loss_mask[0, prompt:] = True
    loss_mask[1, prompt:5] = True  # shorter, padded after
    attn = loss_mask.clone()
    attn[:, :prompt] = True  # row 2: an empty completion (its prompt only)
    teacher_logits = torch.randn(b, length, n_vocab, generator=gen, dtype=torch.float64) * 2
    top_lp, top_ids = torch.log_softmax(teacher_logits, -1).topk(k, dim=-1)
    top_lp = torch.where(loss_mask[..., None], top_lp, float("nan")).float()
    top_ids = torch.where(loss_mask[..., None], top_ids, 10**6)
    behav = torch.where(loss_mask, -torch.rand(b, length, generator=gen), 0.0)
    batch = TensorDict({"input_ids": torch.randint(0, n_vocab, (b, length), generator=gen),
                        "attention_mask": attn, "loss_mask": loss_mask, "logprobs": behav,
                        "versions": torch.zeros(b, length, dtype=torch.long),
                        "rewards": torch.tensor([1.0, 0.0, 1.0]),
                        "group_id": torch.zeros(b, dtype=torch.long),
                        "ref_logp": shift_to_next_token(behav),  # observed only (k1)
                        "ref_top_ids": shift_to_next_token(top_ids),
                        "ref_top_logp": shift_to_next_token(top_lp)}, batch_size=[b])
    config = algorithm_preset("distill_full", group_size=3, kl={"coef": coef},
                              off_policy={"decoupled": False, "recompute_logprob": False})
    prepared = PPOActor(_NoEngine(), config, ref_in_batch=True,
                        tracker=StatsTracker()).compute_advantages(batch)
    mb = pack_sequences(prepared, range(b))
    logits = torch.randn(mb["input_ids"].shape[0], n_vocab, generator=gen, dtype=torch.float64)
    leaf = logits.float().requires_grad_(True)
    make_policy_loss_fn(config, StatsTracker())(leaf, mb).backward()

    x = logits.clone().requires_grad_(True)  # the float64 reference, per sequence
    seq_means = []
    for i, (start, end) in enumerate(zip(mb["cu_seqlens"][:-1], mb["cu_seqlens"][1:],
                                         strict=True)):
        terms = []
        for t in range(int(start), int(end)):
            if not mb["loss_mask"][t]:
                continue
            col = t - int(start) + 1  # the predicted token's column in the padded row
            lp = torch.log_softmax(x[t], -1)
            ratio = torch.exp(lp[mb["input_ids"][t + 1]] - behav[i, col].double())
            adv = mb["advantages"][t].double()
            ppo = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - config.loss.eps_clip,
                                                                 1 + config.loss.eps_clip))
            ref = torch.log_softmax(teacher_logits[i, col], -1)  # the teacher, all of it
            rest = 1 - ref[top_ids[i, col]].exp().sum()
            ref_top_k = torch.full((n_vocab,), float(torch.log(rest / (n_vocab - k))),
                                   dtype=torch.float64)
            ref_top_k[top_ids[i, col]] = ref[top_ids[i, col]]
            terms.append(ppo + coef * (lp.exp() * (lp - ref_top_k)).sum())
        if terms:
            seq_means.append(torch.stack(terms).mean())
    want = torch.stack(seq_means).mean()
    want.backward()
    assert len(seq_means) == 2  # the empty completion trains nothing
    torch.testing.assert_close(leaf.grad.double(), x.grad, atol=1e-6, rtol=1e-4)
    with pytest.raises(KeyError, match="ref_top_ids"):
        make_policy_loss_fn(config, StatsTracker())(leaf, mb.exclude("ref_top_ids"))


class _NoEngine:
    """The advantages need no forward (old log-probs = the behaviour's)."""

    def get_version(self) -> int:
        return 0


def _completion_text(model_dir: Path, output: list[int]) -> str:
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir).decode(output, skip_special_tokens=True)


@pytest.mark.sglang
async def test_a_dead_teacher_fails_samples_under_the_reward_rules(sglang_fleet, tiny_model_dir):
    student = make_engine(sglang_fleet.addresses[:1], SGLANG_TEST_API_KEY)
    student.set_version(fleet_version(sglang_fleet.addresses, SGLANG_TEST_API_KEY))
    executor = RewardExecutor(RewardConfig(use_processes=False, max_failure_rate=0.5,
                                           failure_window=8))
    # nothing listens there: starting its client fails within setup_timeout
    dead = functools.partial(make_engine, ["127.0.0.1:9"], SGLANG_TEST_API_KEY, setup_timeout=1.0)
    workflow = _workflow(tiny_model_dir, TeacherScorer(dead, timeout=30), executor, n=2)
    try:
        with pytest.raises(GroupRewardFailure) as info:
            await workflow.arun_episode(student, DATA)
        assert info.value.survivors is None  # no sample got a reward
        assert [f.fn_name for f in info.value.failures] == ["teacher", "teacher"]
        assert "127.0.0.1:9" in str(info.value.failures[0])
        assert executor.failures["raised"] == 2
        with pytest.raises(RewardBudgetExceeded, match="reward function teacher failed"):
            for _ in range(4):  # 0.5 x 8 = 4 failures allowed; the fifth stops the run
                with pytest.raises(GroupRewardFailure):
                    await workflow.arun_episode(student, DATA)
    finally:
        student.destroy()
        executor.shutdown()


def test_teacher_config_names_bad_values():
    for kwargs, key in (({"n_servers": 0}, "n_servers"), ({"model_path": ""}, "model_path"),
                        ({"request_timeout": 0.0}, "request_timeout")):
        with pytest.raises(ValueError, match=f"TeacherConfig.{key}="):
            TeacherConfig(**kwargs)
    with pytest.raises(ValueError, match="DistillConfig.algorithm.kl.coef=0.0 is invalid"):
        DistillConfig()  # no KL weight: the teacher would be ignored
    with pytest.raises(ValueError, match="DistillConfig.use_ref_model=True"):
        DistillConfig(use_ref_model=True)
    from areal_like.algorithms.actor_checks import check_actor_config
    from areal_like.api.algorithm_config import KLConfig
    from areal_like.api.algorithm_presets import algorithm_preset
    with pytest.raises(ValueError, match="algorithm.kl.discount=1.5"):
        KLConfig(coef=0.5, in_reward=True, discount=1.5)
    with pytest.raises(ValueError, match="algorithm.kl.discount=0.0.*kl.in_reward"):
        KLConfig(coef=0.5, discount=0.0)  # a loss-side KL has nothing to discount
    with pytest.raises(ValueError, match="algorithm.kl.discount=0.0 is for outcome estimators"):
        check_actor_config(algorithm_preset("reinforce_pp", kl={"discount": 0.0}), has_ref=True)
