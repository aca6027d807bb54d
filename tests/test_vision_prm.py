"""A process reward model that sees the picture: step labels of worked counts on the shapes
pictures, the vision PRM's training, and the PRM service as a real process scoring steps
with images over HTTP (the recipe end to end is in test_vision.py, beside its server)."""

from __future__ import annotations

import base64
import io
import math
from pathlib import Path

import pytest
import torch
from PIL import Image

from areal_like.data.prm_shapes import prm_examples
from areal_like.data.shapes import (
    STEP_DELIMITER,
    count_step_labels,
    load_shapes,
    worked_count,
)
from areal_like.models.tiny_vl import build_tiny_vl_model
from areal_like.models.vision import VisionProcessor
from areal_like.rewards.failures import RewardFailure
from areal_like.rewards.prm_client import PRMClient
from areal_like.rewards.prm_server import PRMService
from areal_like.rewards.prm_steps import split_steps
from areal_like.rewards.vision_prm import VisionPRM, build_vision_prm, train_vision_prm

SHAPES = [("red", "square"), ("blue", "circle"), ("red", "triangle")]


def test_worked_counts_are_labelled_step_by_step_from_the_picture():
    steps = split_steps(worked_count(SHAPES, "2"), STEP_DELIMITER)
    assert steps == ["red; ", "blue; ", "red; ", "#### 2"]
    assert count_step_labels(steps, SHAPES, "2") == [1, 1, 1, 1]
    # Math-Shepherd: 0 from the first wrong step on, whatever follows
    wrong_colour = ["red; ", "green; ", "red; ", "#### 2"]
    assert count_step_labels(wrong_colour, SHAPES, "2") == [1, 0, 0, 0]
    left_out = ["red; ", "red; ", "#### 2"]
    assert count_step_labels(left_out, SHAPES, "2") == [1, 0, 0]
    made_up = [*steps[:3], "blue; ", "#### 2"]
    assert count_step_labels(made_up, SHAPES, "2") == [1, 1, 1, 0, 0]
    assert count_step_labels([*steps[:3], "#### 3"], SHAPES, "2") == [1, 1, 1, 0]
    assert count_step_labels(["#### 2"], SHAPES, "2") == [0]  # no shape listed


def test_worked_targets_only_where_asked_and_only_for_counts():
    items = load_shapes(40, "train", seed=1, question="count", worked_fraction=0.5)
    worked = [r for r in items if r["target"] != r["answer"]]
    assert 10 <= len(worked) <= 30  # about half
    for r in worked:
        shapes = [tuple(s) for s in r["shapes"]]
        assert r["target"] == worked_count(shapes, r["answer"])
        assert r["answer"] == str(sum(c in r["messages"][0]["content"][1]["text"].split()
                                      for c, _ in shapes))
    with pytest.raises(ValueError, match="worked_fraction=0.5 needs question='count'"):
        load_shapes(4, "train", question="colour", worked_fraction=0.5)


@pytest.fixture(scope="module")
def prm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    policy = build_tiny_vl_model(tmp_path_factory.mktemp("tiny_vl"))
    return build_vision_prm(tmp_path_factory.mktemp("vision_prm"), policy, seed=2)


def test_prm_examples_follow_the_picture(prm_dir):
    examples = prm_examples(VisionProcessor(prm_dir), 60, seed=3)
    n_changed = 0
    for e in examples:
        assert len(e.labels) == len(e.steps) and e.labels == sorted(e.labels, reverse=True)
        assert e.prompt.count("<|image_pad|>") == len(e.images) == 1
        n_changed += 0 in e.labels
    assert 15 <= n_changed <= 50  # malformed (a fifth) and changed (half of the rest)


def test_the_policys_own_samples_are_labelled_from_their_pictures(prm_dir):
    from areal_like.data.prm_shapes import policy_examples

    examples = policy_examples(str(prm_dir), 6, seed=1, max_new_tokens=12)
    assert examples and all(e.prompt.count("<|image_pad|>") == 1 for e in examples)
    for e in examples:  # a random model's text: labelled by the picture, mostly wrong
        item = next(r for r in load_shapes(6, "train", 8, question="count")
                    if r["images"] == e.images)
        assert "".join(e.steps).strip() and e.labels == count_step_labels(
            list(e.steps), [tuple(s) for s in item["shapes"]], item["answer"])


def _loss(prm: VisionPRM, examples) -> float:
    total, count = 0.0, 0
    with torch.no_grad():
        for e in examples:
            scores = torch.tensor(prm.scores(e.prompt, e.images, e.steps), dtype=torch.float64)
            labels = torch.tensor(e.labels, dtype=torch.float64)
            total -= float((labels * scores.log() + (1 - labels) * (1 - scores).log()).sum())
            count += len(e.labels)
    return total / count


def test_training_the_vision_prm_lowers_its_held_out_loss(prm_dir, tmp_path):
    import shutil

    path = Path(shutil.copytree(prm_dir, tmp_path / "prm"))
    processor = VisionProcessor(path)
    held_out = prm_examples(processor, 40, "test", seed=4)
    before = _loss(VisionPRM(path).eval(), held_out)
    tower = {k: v.clone() for k, v in VisionPRM(path).vlm.model.visual.state_dict().items()}
    stats = train_vision_prm(path, prm_examples(processor, 400, seed=4), steps=60)
    trained = VisionPRM(path).eval()
    assert stats["steps"] == 60
    # beyond the label prior: measured 0.70 -> 0.56, the label-1 share (0.47) alone gives 0.69
    share = sum(sum(e.labels) for e in held_out) / sum(len(e.labels) for e in held_out)
    prior = -(share * math.log(share) + (1 - share) * math.log(1 - share))
    after = _loss(trained, held_out)
    assert after < before - 0.1 and after < prior - 0.08
    assert all(torch.equal(v, tower[k]) for k, v in trained.vlm.model.visual.state_dict().items())


def _b64(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


async def test_the_service_scores_steps_with_the_picture(prm_dir, tmp_path, executor_factory):
    processor = VisionProcessor(prm_dir)
    (item,) = prm_examples(processor, 1, "test", seed=5, malformed=0.0)
    picture = Image.open(io.BytesIO(item.images[0]))
    other = Image.new("RGB", picture.size, (30, 60, 220))
    steps = list(item.steps)
    with PRMService(prm_dir, startup_timeout=120, log_path=tmp_path / "prm.log") as svc:
        client = PRMClient(svc.url, timeout=60, executor=executor_factory())
        try:
            scores = await client.score(item.prompt, steps, [_b64(picture)])
            elsewhere = await client.score(item.prompt, steps, [_b64(other)])
            with pytest.raises(RewardFailure, match="HTTP 400.*image"):
                await client.score(item.prompt, steps)  # the prompt's image pad, no image
            with pytest.raises(RewardFailure, match="HTTP 400.*'images'.*not base64"):
                await client.score(item.prompt, steps, ["not base64!"])
        finally:
            await client.close()
    expected = VisionPRM(prm_dir).eval().scores(item.prompt, [picture], steps)
    assert scores == pytest.approx(expected, abs=1e-9)  # same float32 model, float64 softmax
    assert len(scores) == len(steps) and all(0.0 < s < 1.0 for s in scores)
    assert max(abs(a - b) for a, b in zip(scores, elsewhere, strict=True)) > 1e-6
    assert client.executor.n_calls == 4 and client.executor.n_failed == 2
