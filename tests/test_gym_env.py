"""Gymnasium-style text environments as episodes (workflows/gym_env.py) on the session's real
SGLang fleet: a registered `gymnasium.make` id and a user's factory, each environment's own
observations and rewards, turns that reuse the earlier turns' exact token ids; checked against
a replay of the environment on the actions the trained tokens spell. An environment that
breaks fails its episode with its own error, never a reward of 0."""

from __future__ import annotations

import pytest
import torch
from conftest import SGLANG_TEST_API_KEY
from sglang_helpers import fleet_version, make_controller
from transformers import AutoTokenizer

from areal_like.api import GenerationHyperparameters
from areal_like.api.seeding import begin_episode
from examples.gym_envs.guess_number import GuessNumber
from workflows.gym_env import EnvError, GymTextWorkflow

pytestmark = pytest.mark.sglang
ENV_ID = "examples.gym_envs.guess_number:GuessNumber-v0"
WAIT_S = 300  # a bound for a hang, not the expected time


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def controller(sglang_fleet):
    controller = make_controller(sglang_fleet.addresses, SGLANG_TEST_API_KEY)
    yield controller
    controller.destroy()


def _run(controller, workflow, item, seed: int):
    async def episode():
        begin_episode(seed)  # as the executor does: the episode's seeds
        return await workflow.arun_episode(controller, item)

    return controller.run_coroutine(episode(), timeout=WAIT_S)


def _spans(row_ids: torch.Tensor, mask: torch.Tensor, tokenizer) -> list[str]:
    """The texts of the trained spans of one row: the policy's replies, in order."""
    spans, current = [], []
    for token, trained in zip(row_ids.tolist(), mask.tolist(), strict=True):
        if trained:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    if current:
        spans.append(current)
    return [tokenizer.decode(s, skip_special_tokens=True) for s in spans]


def _replay(secret: int, actions: list[str], max_guesses: int,
            **bounds: int) -> tuple[list[str], list[float]]:
    """The environment's observations after each action and its rewards, on its own."""
    env = GuessNumber(max_guesses=max_guesses, **bounds)
    observations, rewards = [], []
    env.reset(options={"secret": secret})
    for action in actions:
        observation, reward, terminated, truncated, _ = env.step(action)
        observations.append(observation)
        rewards.append(reward)
        if terminated or truncated:
            break
    return observations, rewards


def test_text_environments_are_multi_turn_episodes(controller, sglang_fleet, tokenizer):
    gconfig = GenerationHyperparameters(max_new_tokens=4, n_samples=2, temperature=1.0)
    registered = GymTextWorkflow(ENV_ID, gconfig, tokenizer, max_turns=3,
                                 env_kwargs={"max_guesses": 3})
    batch = _run(controller, registered, {"id": 1, "secret": 7}, seed=5)
    # one row per conversation, its reward the environment's own on the replayed actions,
    # every user turn after the first the environment's answer to the reply before it
    assert batch["input_ids"].shape[0] == 2 and batch["group_id"].unique().numel() == 1
    for i in range(2):
        mask = batch["loss_mask"][i].bool()
        actions = _spans(batch["input_ids"][i], mask, tokenizer)
        observations, rewards = _replay(7, actions, max_guesses=3)
        assert len(actions) == len(rewards)  # it stopped when the environment said so
        assert batch["rewards"][i].item() == sum(rewards)
        text = tokenizer.decode(batch["input_ids"][i])
        for observation in observations[:-1]:
            assert f"<|im_start|>user\n{observation}<|im_end|>" in text
        version = fleet_version(sglang_fleet.addresses, SGLANG_TEST_API_KEY)
        assert set(batch["versions"][i][mask].tolist()) == {version}
        assert torch.isfinite(batch["logprobs"][i][mask]).all()

    # a user's factory, one row per reply with its returns-to-go; the reset seed is the
    # episode's: the same episode seed draws the same secrets, another seed other ones
    secrets: list[int] = []

    def factory(item):
        env = GuessNumber(low=1000, high=1999, max_guesses=2)  # no lucky guess: 2 replies
        real_reset = env.reset

        def reset(**kwargs):
            observation, info = real_reset(**kwargs)
            secrets.append(info["secret"])
            return observation, info

        env.reset = reset  # type: ignore[method-assign]
        return env

    own = GymTextWorkflow(factory, gconfig, tokenizer, max_turns=4, turn_discount=0.5,
                          export_style="individual")
    rows = _run(controller, own, {"id": 2}, seed=9)
    drawn = list(secrets)  # reset in the order the samples start: rows 0-1, then 2-3
    _run(controller, own, {"id": 2}, seed=9)
    assert secrets[2:] == drawn
    _run(controller, own, {"id": 2}, seed=10)
    assert secrets[4:] != drawn
    assert rows["input_ids"].shape[0] == 4  # two episodes of two replies
    for sample, secret in enumerate(drawn):
        ids = [2 * sample, 2 * sample + 1]
        actions = [_spans(rows["input_ids"][i], rows["loss_mask"][i].bool(), tokenizer)[0]
                   for i in ids]
        _, rewards = _replay(secret, actions, max_guesses=2, low=1000, high=1999)
        assert rows["rewards"][ids].tolist() == [rewards[0] + 0.5 * rewards[1], rewards[1]]


def test_a_broken_environment_fails_its_episode_with_its_own_error(controller, tokenizer):
    gconfig = GenerationHyperparameters(max_new_tokens=2)

    class Broken(GuessNumber):
        def step(self, action):
            raise RuntimeError("the environment's own bug")

    class NotText(GuessNumber):
        def reset(self, **kwargs):
            return [1, 2], {}

    with pytest.raises(RuntimeError, match="the environment's own bug"):
        _run(controller, GymTextWorkflow(lambda item: Broken(), gconfig, tokenizer), {"id": 3}, 1)
    with pytest.raises(EnvError, match="its first observation is list, not text"):
        _run(controller, GymTextWorkflow(lambda item: NotText(), gconfig, tokenizer), {"id": 4}, 1)
    with pytest.raises(ValueError, match="no gymnasium environment 'NoSuch-v9'"):
        GymTextWorkflow("NoSuch-v9", gconfig, tokenizer)
