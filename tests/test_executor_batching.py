"""concat_padded, trajectory (de)serialisation and min_generated_version, against references
built by hand in the test."""

from __future__ import annotations

import io

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

from areal_like.rollout import concat_padded, min_generated_version
from areal_like.utils.batching import trajectory_from_state, trajectory_to_state


def group(ids: list[list[int]], version: int, reward: float, tag: str) -> TensorDict:
    """Rows already padded to a common length by the caller (0 = pad)."""
    input_ids = torch.tensor(ids)
    attn = input_ids != 0
    loss = attn.clone()
    loss[:, 0] = False  # first token is the prompt
    versions = torch.where(loss, version, -1)
    td = TensorDict({
        "input_ids": input_ids,
        "attention_mask": attn,
        "loss_mask": loss,
        "logprobs": torch.where(loss, -0.25, 0.0),
        "versions": versions,
        "rewards": torch.full((len(ids),), reward),
        "extra": {"values": input_ids.float() * 0.5},
    }, batch_size=[len(ids)])
    td["tag"] = NonTensorStack(*[f"{tag}{i}" for i in range(len(ids))])
    return td


def test_concat_padded_matches_manual_reference():
    a = group([[5, 6, 7], [5, 8, 0]], version=3, reward=1.0, tag="a")
    b = group([[9, 1, 2, 3, 4]], version=4, reward=0.0, tag="b")
    out = concat_padded([a, b])
    assert out.batch_size == torch.Size([3])
    expected_ids = torch.tensor([[5, 6, 7, 0, 0], [5, 8, 0, 0, 0], [9, 1, 2, 3, 4]])
    assert torch.equal(out["input_ids"], expected_ids)
    assert out["input_ids"].dtype == torch.long
    assert torch.equal(out["attention_mask"], expected_ids != 0)
    assert out["attention_mask"].dtype == torch.bool
    expected_versions = torch.tensor([[-1, 3, 3, -1, -1], [-1, 3, -1, -1, -1],
                                      [-1, 4, 4, 4, 4]])
    assert torch.equal(out["versions"], expected_versions)
    expected_logprobs = torch.where(expected_versions >= 0, -0.25, 0.0)
    assert torch.equal(out["logprobs"], expected_logprobs)
    assert torch.equal(out["loss_mask"], expected_versions >= 0)
    assert torch.equal(out["rewards"], torch.tensor([1.0, 1.0, 0.0]))
    assert torch.equal(out["extra", "values"], expected_ids.float() * 0.5)
    assert out.get("tag").tolist() == ["a0", "a1", "b0"]


def test_concat_padded_custom_pad_and_single_item():
    a = group([[5, 6]], version=0, reward=1.0, tag="a")
    b = group([[5, 6, 7, 8]], version=0, reward=1.0, tag="b")
    out = concat_padded([a, b], pad_values={"input_ids": 99})
    assert out["input_ids"][0].tolist() == [5, 6, 99, 99]
    same = concat_padded([a])
    assert torch.equal(same["input_ids"], a["input_ids"])


def test_concat_padded_errors_name_the_key():
    a = group([[5, 6]], version=0, reward=1.0, tag="a")
    b = group([[5, 6, 7]], version=0, reward=1.0, tag="b")
    with pytest.raises(ValueError, match="empty"):
        concat_padded([])
    c = b.clone()
    del c["rewards"]
    with pytest.raises(KeyError, match="rewards"):
        concat_padded([a, c])
    d = b.clone()
    d["logprobs"] = d["logprobs"].double()
    with pytest.raises(ValueError, match="logprobs"):
        concat_padded([a, d])
    with pytest.raises(ValueError, match="batch_size"):
        concat_padded([TensorDict({"x": torch.zeros(2, 3)}, batch_size=[2, 3])])
    with pytest.raises(TypeError, match="not a TensorDict"):
        concat_padded([{"input_ids": torch.zeros(1, 2)}])


def test_min_generated_version_uses_trained_tokens_only():
    td = group([[5, 6, 7]], version=2, reward=1.0, tag="a")
    td["versions"][0, 2] = 1  # a mid-request weight update: the last token is older
    assert min_generated_version(td) == 1
    td["loss_mask"][0, 2] = False  # not trained on: its version does not count
    assert min_generated_version(td) == 2
    td["loss_mask"][:] = False
    assert min_generated_version(td) is None


def test_trajectory_state_round_trip_weights_only():
    td = group([[5, 6, 7], [5, 8, 0]], version=3, reward=1.0, tag="a")
    buffer = io.BytesIO()
    torch.save(trajectory_to_state(td), buffer)
    buffer.seek(0)
    back = trajectory_from_state(torch.load(buffer, weights_only=True))
    assert back.batch_size == td.batch_size
    for key in ("input_ids", "attention_mask", "loss_mask", "logprobs", "versions", "rewards"):
        assert torch.equal(back[key], td[key]) and back[key].dtype == td[key].dtype
    assert torch.equal(back["extra", "values"], td["extra", "values"])
    assert back.get("tag").tolist() == ["a0", "a1"]
