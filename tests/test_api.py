"""Public contracts: data types and trajectory validation."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from areal_like.api import (
    GenerationHyperparameters,
    InferenceEngine,
    ModelRequest,
    ModelResponse,
    RolloutWorkflow,
    TrainEngine,
    TrajectoryError,
    WeightUpdateMeta,
    validate_trajectory,
)


def test_gconfig_new_copies_and_rejects_unknown_fields():
    g = GenerationHyperparameters(max_new_tokens=8)
    g2 = g.new(greedy=True, n_samples=4)
    assert (g2.greedy, g2.n_samples, g2.max_new_tokens) == (True, 4, 8)
    assert (g.greedy, g.n_samples) == (False, 1)
    with pytest.raises(TypeError, match="temprature"):
        g.new(temprature=0.5)
    with pytest.raises(ValueError, match="top_p"):
        g.new(top_p=0.0)


def test_request_ids_are_unique_and_response_checks_lengths():
    assert ModelRequest(input_ids=[1]).rid != ModelRequest(input_ids=[1]).rid
    ok = ModelResponse([1, 2], [3, 4], [-0.1, -0.2], [0, 1], stop_reason="length")
    assert (ok.input_len, ok.output_len) == (2, 2)
    with pytest.raises(ValueError, match="output_versions has 1"):
        ModelResponse([1], [3, 4], [-0.1, -0.2], [0], rid="r1")
    with pytest.raises(ValueError, match="stop_reason"):
        ModelResponse([1], [3], [-0.1], [0], stop_reason="eos")


def test_weight_update_meta():
    assert WeightUpdateMeta.from_disk("/tmp/w", 3).version == 3
    with pytest.raises(ValueError, match="path"):
        WeightUpdateMeta(version=1)


def test_abstract_contracts_cannot_be_instantiated():
    for cls in (InferenceEngine, TrainEngine, RolloutWorkflow):
        with pytest.raises(TypeError):
            cls()


def _trajectory(b: int = 2, n: int = 6) -> TensorDict:
    loss = torch.zeros(b, n, dtype=torch.bool)
    loss[:, 3:] = True
    versions = torch.full((b, n), -1)
    versions[:, 3:] = 2
    return TensorDict(
        {
            "input_ids": torch.randint(0, 50, (b, n)),
            "attention_mask": torch.ones(b, n, dtype=torch.bool),
            "loss_mask": loss,
            "logprobs": -torch.rand(b, n),
            "versions": versions,
            "rewards": torch.tensor([1.0, 0.0])[:b],
        },
        batch_size=[b],
    )


def test_valid_trajectory_passes():
    td = _trajectory()
    assert validate_trajectory(td) is td
    td["rewards"] = torch.rand(2, 6)  # dense per-token rewards are allowed
    validate_trajectory(td)
    del td["logprobs"]  # a custom loss may need no behaviour log-probs (AReaL-lite's REINFORCE)
    validate_trajectory(td)


@pytest.mark.parametrize(
    "mutate, key_in_message",
    [
        (lambda td: td.del_("versions"), "versions"),
        (lambda td: td.set("logprobs", torch.zeros(2, 5)), "logprobs"),
        (lambda td: td.set("input_ids", td["input_ids"].float()), "input_ids"),
        (lambda td: td.set("loss_mask", torch.ones(2, 5, dtype=torch.bool)), "loss_mask"),
        (lambda td: td.set("rewards", torch.tensor([float("nan"), 1.0])), "rewards"),
        (lambda td: td.set("rewards", torch.tensor([1, 0])), "rewards"),
        (lambda td: td.set("versions", td["versions"].float()), "versions"),
        (lambda td: td.set("logprobs", torch.full((2, 6), float("inf"))), "logprobs"),
    ],
)
def test_invalid_trajectory_names_the_key(mutate, key_in_message):
    td = _trajectory()
    mutate(td)
    with pytest.raises(TrajectoryError, match=key_in_message):
        validate_trajectory(td)


def test_shape_mismatch_message_states_expected_shape():
    bad = _trajectory()
    bad["loss_mask"] = torch.ones(2, 5, dtype=torch.bool)
    with pytest.raises(TrajectoryError, match=r"'loss_mask' has shape \(2, 5\).*expected shape \(2, 6\)"):
        validate_trajectory(bad)


def test_loss_on_unattended_or_unversioned_tokens_is_rejected():
    td = _trajectory()
    td["attention_mask"][0, -1] = False
    with pytest.raises(TrajectoryError, match="attention_mask"):
        validate_trajectory(td)
    td = _trajectory()
    td["versions"][1, 4] = -1
    with pytest.raises(TrajectoryError, match="versions"):
        validate_trajectory(td)
