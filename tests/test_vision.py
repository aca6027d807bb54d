"""Vision-language models: the tiny Qwen2-VL, prompts with images, and a real SGLang server
serving it with images (log-probabilities against an HF float64 forward of the same weights on
the same pixels, before and after a weight update that changes only the vision tower)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import shutil
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import vision_worker as VW
from config_helpers import rollout_config
from PIL import Image
from safetensors.torch import load_file, save_file
from sglang_helpers import LOGPROB_ATOL
from tensordict import TensorDict

from areal_like.api.config import DatasetConfig
from areal_like.api.io_struct import GenerationHyperparameters, ModelRequest, WeightUpdateMeta
from areal_like.models.vision import (
    ImageInputError,
    VisionProcessor,
    VisionPrompt,
    load_image,
)

# servers and torchrun jobs of its own only (no session fleet): beside the serial lane
pytestmark = [pytest.mark.beside_serial]


@pytest.fixture(scope="module")
def tiny_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from areal_like.models.tiny_vl import build_tiny_vl_model

    return build_tiny_vl_model(tmp_path_factory.mktemp("tiny_vl"), seed=1)


@pytest.fixture(scope="module")
def processor(tiny_vl_dir: Path) -> VisionProcessor:
    return VisionProcessor(tiny_vl_dir)


# ---- prompts with images (no server) -----------------------------------------------------------
def test_an_image_reads_the_same_from_pil_path_and_bytes(tmp_path):
    image = VW.noise_image(60, 40, seed=0)
    image.save(tmp_path / "a.png")
    as_bytes = (tmp_path / "a.png").read_bytes()
    loaded = [load_image(x) for x in (image, tmp_path / "a.png", str(tmp_path / "a.png"),
                                      as_bytes)]
    assert all(x.mode == "RGB" and x.tobytes() == image.tobytes() for x in loaded)
    with pytest.raises(ImageInputError, match="missing.png.*does not exist"):
        load_image(tmp_path / "missing.png", "dataset row 3")
    with pytest.raises(ImageInputError, match="image 1: 5 bytes is not a readable image"):
        load_image(b"\x89PNGx", "image 1")
    with pytest.raises(ImageInputError, match="expected a PIL image, a path or bytes, got int"):
        load_image(7)  # type: ignore[arg-type]


def test_each_image_pad_expands_to_its_images_tokens(processor):
    # 56 x 56 -> 4 x 4 patches -> 4 tokens; 84 x 56 -> 4 x 6 -> 6; 300 x 200 is resized into
    # the processor's pixel budget (84 x 112 -> 6 x 8 patches -> 12 tokens)
    images = [VW.noise_image(56, 56, 1), VW.noise_image(84, 56, 2), VW.noise_image(300, 200, 3)]
    prompt = processor.prompt(VW.messages(3), images)
    pad = processor.image_token_id
    assert prompt.input_ids.count(pad) == 3 and len(prompt.image_data) == 3
    assert prompt.image_grid_thw.tolist() == [[1, 4, 4], [1, 4, 6], [1, 6, 8]]
    assert prompt.pixel_values.shape == (16 + 24 + 48, 3 * 2 * 14 * 14)
    assert prompt.expanded_ids.count(pad) == 4 + 6 + 12
    # outside the pads, the expanded prompt is the prompt
    assert [t for t in prompt.expanded_ids if t != pad] == [t for t in prompt.input_ids
                                                            if t != pad]
    # the base64 PNGs decode to exactly the pixels that were processed: a fitting image as
    # it was, a larger one already resized, so that the server does not resample it again
    decoded = [Image.open(io.BytesIO(base64.b64decode(d))) for d in prompt.image_data]
    assert decoded[1].tobytes() == images[1].tobytes()
    assert decoded[2].size == (112, 84)
    assert processor.prompt_from_ids(prompt.input_ids, decoded).pixel_values.equal(
        prompt.pixel_values)


def test_image_counts_that_do_not_match_are_named(processor):
    with pytest.raises(ValueError, match="1 image part.*2 image"):
        processor.prompt(VW.messages(1), [VW.noise_image(56, 56, 1), VW.noise_image(56, 56, 2)])
    ids = processor.prompt(VW.messages(1), [VW.noise_image(56, 56, 1)]).input_ids
    with pytest.raises(ValueError, match="1 image pad token.*0 image"):
        processor.prompt_from_ids(ids, [])
    with pytest.raises(TypeError, match=r"image_data\[0\] is a bytes; expected a base64"):
        ModelRequest(input_ids=ids, image_data=[b"png"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="not a vision-language model folder"):
        from areal_like.models.tiny import build_tiny_model

        VisionProcessor(build_tiny_model(Path(processor.tokenizer.name_or_path).parent / "text"))


def test_the_vllm_backend_refuses_images_by_name():
    from engines.fleet.backends import server_api

    with pytest.raises(ValueError, match="vLLM backend does not take images"):
        server_api("vllm", "").add_images({}, ["aGk="])


# ---- a real SGLang server -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def _module_vl_server(tiny_vl_dir: Path,
                      tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from conftest import SGLANG_TEST_API_KEY
    from sglang_helpers import require_sglang_venv

    from areal_like.api.config import ServerConfig
    from engines.fleet.launch import InferenceFleet

    require_sglang_venv()
    config = ServerConfig(n_servers=1, max_total_tokens=8192)
    with InferenceFleet(tiny_vl_dir, config, api_key=SGLANG_TEST_API_KEY,
                        log_dir=tmp_path_factory.mktemp("vl_logs")) as fleet:
        yield fleet


@pytest.fixture
def vl_server(_module_vl_server: Any, tiny_vl_dir: Path) -> Any:
    """The module's server as a just-started one: `tiny_vl_dir` under version 0, whatever an
    earlier test (in any order) loaded into it."""
    from sglang_helpers import reset_fleet

    reset_fleet(_module_vl_server, tiny_vl_dir)
    return _module_vl_server


def _reference_logprobs(model_dir: Path, prompt: VisionPrompt, output: list[int],
                        image_token_id: int) -> torch.Tensor:
    """float64 log p(output[i] | prompt, output[:i]) from HF's Qwen2-VL on the same pixels."""
    from transformers import Qwen2VLForConditionalGeneration

    model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float64)
    ids = torch.tensor([prompt.expanded_ids + output])
    with torch.no_grad():
        logits = model.eval()(input_ids=ids, pixel_values=prompt.pixel_values.double(),
                              image_grid_thw=prompt.image_grid_thw,
                              mm_token_type_ids=(ids == image_token_id).long()).logits[0]
    logprobs = torch.log_softmax(logits[len(prompt.expanded_ids) - 1:-1], dim=-1)
    return logprobs.gather(-1, torch.tensor(output)[:, None])[:, 0]


def _vision_tower_perturbed(src: Path, dst: Path, scale: float = 0.5) -> Path:
    """`src` with noise added to the vision tower's weights only."""
    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    gen = torch.Generator().manual_seed(7)
    changed = {name: t + scale * torch.randn(t.shape, generator=gen)
               if name.startswith("visual.") else t for name, t in tensors.items()}
    save_file(changed, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.sglang
@pytest.mark.e2e
def test_the_server_serves_images_like_hf_before_and_after_a_vision_tower_update(
        vl_server, tiny_vl_dir, processor, tmp_path):
    from sglang_helpers import fleet_engine

    pad = processor.image_token_id
    prompts = [processor.prompt(VW.messages(1), [VW.noise_image(56, 56, 11)]),
               processor.prompt(VW.messages(1), [VW.noise_image(300, 200, 12)]),
               processor.prompt(VW.messages(2), [VW.noise_image(84, 56, 13), VW.noise_image(56, 112, 14)])]
    g = GenerationHyperparameters(max_new_tokens=8, temperature=1.0)
    engine = fleet_engine(vl_server)

    def generate() -> list[Any]:
        async def run() -> list[Any]:
            return await asyncio.gather(*(engine.agenerate(ModelRequest(
                input_ids=p.input_ids, image_data=p.image_data, gconfig=g, seed=100 + i))
                for i, p in enumerate(prompts)))
        return asyncio.run(run())

    def max_error(replies: list[Any], model_dir: Path) -> float:
        return max(float((torch.tensor(r.output_logprobs, dtype=torch.float64)
                          - _reference_logprobs(model_dir, p, r.output_tokens, pad)).abs().max())
                   for p, r in zip(prompts, replies, strict=True))

    try:
        before = generate()
        assert all(r.output_len == 8 and set(r.output_versions) == {0} for r in before)
        assert max_error(before, tiny_vl_dir) < LOGPROB_ATOL
        # the comparison sees the image: the same tokens under another image disagree
        swapped = processor.prompt(VW.messages(1), [VW.noise_image(56, 56, 99)])
        wrong = _reference_logprobs(tiny_vl_dir, swapped, before[0].output_tokens, pad)
        assert float((torch.tensor(before[0].output_logprobs) - wrong).abs().max()) > 1e-3

        updated = _vision_tower_perturbed(tiny_vl_dir, tmp_path / "v1")
        engine.update_weights(WeightUpdateMeta(version=1, path=str(updated)))
        after = generate()
        assert all(set(r.output_versions) == {1} for r in after)
        assert max_error(after, updated) < LOGPROB_ATOL
        # only the vision tower changed, and what the server computes changed with it
        assert max_error(after, tiny_vl_dir) > 1e-3
    finally:
        engine.destroy()


# ---- the FSDP2 engine on images (one rank, in this process) -------------------------------------
def _reference_step(model_dir: Path, batch: TensorDict, prompts: list[VisionPrompt],
                    image_token_id: int, freeze_vision: bool = False) -> dict[str, Any]:
    """HF Qwen2-VL in float64, one row at a time: each row's next-token log-probs, the
    token-mean NLL over all loss tokens, and the weights after one step on it (clipped to norm
    1, AdamW with the worker's lr and eps; over the language half only with `freeze_vision`)."""
    from transformers import Qwen2VLForConditionalGeneration

    model = Qwen2VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float64)
    if freeze_vision:
        model.model.visual.requires_grad_(False)
    total, count, per_row = torch.zeros((), dtype=torch.float64), 0, []
    for row, prompt in enumerate(prompts):
        n = int(batch["attention_mask"][row].sum())
        ids = batch["input_ids"][row, :n][None]
        images = {"pixel_values": prompt.pixel_values.double(),
                  "image_grid_thw": prompt.image_grid_thw} if prompt.image_data else {}
        logits = model(input_ids=ids, mm_token_type_ids=(ids == image_token_id).long(),
                       **images).logits[0]
        logp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
        per_row.append(logp.detach())
        mask = batch["loss_mask"][row, 1:n].bool()
        total, count = total - logp[mask].sum(), count + int(mask.sum())
    loss = total / count
    params = dict(model.named_parameters())
    trained = [p for p in params.values() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=VW.LR, eps=VW.EPS, weight_decay=0.0)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(trained, 1.0)
    opt.step()
    return {"logprobs": per_row, "loss": loss.item(),
            "weights": {k: v.detach() for k, v in params.items()}}


def _assert_like_reference(reference: dict[str, Any], logprobs: list[torch.Tensor], loss: float,
                           weights: dict[str, torch.Tensor], model_dir: Path) -> None:
    for row, (got, expected) in enumerate(zip(logprobs, reference["logprobs"], strict=True)):
        assert (got[:len(expected)].double() - expected).abs().max() < 1e-5, row
    assert loss == pytest.approx(reference["loss"], abs=1e-5)
    assert weights.keys() == reference["weights"].keys()
    assert all((weights[k].double() - v).abs().max() < 1e-6
               for k, v in reference["weights"].items())
    # every tensor of the vision tower got a gradient and moved (measured: 1.2e-5 to 6.6e-4)
    from transformers import Qwen2VLForConditionalGeneration

    initial = Qwen2VLForConditionalGeneration.from_pretrained(model_dir).state_dict()
    vision = [k for k in weights if ".visual." in k]
    assert vision and min(float((weights[k] - initial[k]).abs().max()) for k in vision) > 1e-6


def test_the_engine_packs_images_and_trains_the_vision_tower_like_hf_float64(tiny_vl_dir,
                                                                            processor):
    from areal_like.api.config import MicroBatchSpec
    from engines import FSDPEngine

    batch, prompts = VW.image_batch(processor)
    # two micro-batches: two rows (with their images) pack into one
    engine = FSDPEngine(VW.config(str(tiny_vl_dir), MicroBatchSpec(max_tokens_per_mb=128,
                                                                   n_mbs=2)))
    engine.initialize()
    try:
        logprobs = engine.forward(batch)
        stats = engine.train_batch(batch, VW.mean_nll, VW.n_loss_tokens)
        weights = {k: v.full_tensor() for k, v in engine.model.state_dict().items()}
    finally:
        engine.destroy()
    reference = _reference_step(tiny_vl_dir, batch, prompts, processor.image_token_id)
    _assert_like_reference(reference, list(logprobs), stats["loss"], weights, tiny_vl_dir)


def test_a_frozen_vision_tower_stays_put_while_the_language_half_trains_like_hf(
        tiny_vl_dir, processor, tiny_model_dir):
    from transformers import Qwen2VLForConditionalGeneration

    from areal_like.api.config import MicroBatchSpec
    from engines import FSDPEngine

    batch, prompts = VW.image_batch(processor)
    config = VW.config(str(tiny_vl_dir), MicroBatchSpec(max_tokens_per_mb=128))
    config.freeze_vision_tower = True
    engine = FSDPEngine(config)
    engine.initialize()
    try:
        stats = engine.train_batch(batch, VW.mean_nll, VW.n_loss_tokens)
        weights = {k: v.full_tensor() for k, v in engine.model.state_dict().items()}
    finally:
        engine.destroy()
    reference = _reference_step(tiny_vl_dir, batch, prompts, processor.image_token_id,
                                freeze_vision=True)
    assert stats["loss"] == pytest.approx(reference["loss"], abs=1e-5)
    assert all((weights[k].double() - v).abs().max() < 1e-6
               for k, v in reference["weights"].items())
    initial = Qwen2VLForConditionalGeneration.from_pretrained(tiny_vl_dir).state_dict()
    vision = [k for k in weights if ".visual." in k]
    assert vision and all(torch.equal(weights[k], initial[k]) for k in vision)
    assert any(not torch.equal(weights[k], initial[k]) for k in weights if k not in vision)
    # a text model has no vision tower: the key is named, not ignored
    config.model.path = str(tiny_model_dir)
    with pytest.raises(ValueError, match="freeze_vision_tower.*not a vision-language model"):
        FSDPEngine(config).initialize()


def _values_loss(values: torch.Tensor, mb: TensorDict) -> torch.Tensor:
    return ((values.squeeze(-1) - 1.0) ** 2).mean()


def test_a_value_head_on_the_vlm_reads_the_images_and_trains_like_hf_float64(tiny_vl_dir,
                                                                              processor):
    from transformers import Qwen2VLForConditionalGeneration

    from areal_like.api.config import MicroBatchSpec
    from engines import FSDPEngine

    batch, prompts = VW.image_batch(processor)
    config = VW.config(str(tiny_vl_dir), MicroBatchSpec(max_tokens_per_mb=128, n_mbs=2))
    config.model.is_critic = True
    engine = FSDPEngine(config)
    engine.initialize()
    try:
        head = {k: v.full_tensor().clone() for k, v in engine.model.lm_head.state_dict().items()}
        values = engine.forward(batch)
        engine.train_batch(batch, _values_loss, lambda mb: float(mb["input_ids"].shape[0]))
        weights = {k: v.full_tensor() for k, v in engine.model.state_dict().items()}
    finally:
        engine.destroy()
    assert head["weight"].shape == (1, 128) and head["weight"].std() > 0
    # reference: HF in float64 with the engine's initial head in place of the LM head
    model = Qwen2VLForConditionalGeneration.from_pretrained(tiny_vl_dir, dtype=torch.float64)
    model.lm_head = torch.nn.Linear(128, 1, dtype=torch.float64)
    model.lm_head.load_state_dict({k: v.double() for k, v in head.items()})
    per_row = []
    for row, prompt in enumerate(prompts):
        n = int(batch["attention_mask"][row].sum())
        ids = batch["input_ids"][row, :n][None]
        images = {"pixel_values": prompt.pixel_values.double(),
                  "image_grid_thw": prompt.image_grid_thw} if prompt.image_data else {}
        out = model(input_ids=ids, mm_token_type_ids=(ids == processor.image_token_id).long(),
                    **images).logits[0, :, 0]
        assert (values[row, :n].double() - out).abs().max() < 1e-5, row
        per_row.append(out)
    # one step on the squared error to 1.0, averaged over every token of the batch
    opt = torch.optim.AdamW(model.parameters(), lr=VW.LR, eps=VW.EPS, weight_decay=0.0)
    loss = ((torch.cat(per_row) - 1.0) ** 2).mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    moved = model.state_dict()
    assert weights.keys() == moved.keys()
    assert all((weights[k].double() - v).abs().max() < 1e-6 for k, v in moved.items())
    assert (weights["lm_head.weight"] - head["weight"]).abs().max() > 1e-6


@pytest.mark.torchrun
@pytest.mark.e2e
def test_two_ranks_one_without_images_train_like_hf_float64(tiny_vl_dir, processor, tmp_path):
    from torchrun_helpers import run_worker

    run = run_worker("vision_worker.py", tiny_vl_dir, tmp_path)
    assert run["world_size"] == 2
    by_rank = [torch.load(tmp_path / f"logprobs_rank{r}.pt") for r in (0, 1)]
    logprobs = [by_rank[r][i] for r, rows in enumerate(VW.RANK_ROWS) for i in range(len(rows))]
    assert [row for rows in VW.RANK_ROWS for row in rows] == [0, 1, 2]
    batch, prompts = VW.image_batch(processor)
    reference = _reference_step(tiny_vl_dir, batch, prompts, processor.image_token_id)
    _assert_like_reference(reference, logprobs, run["loss"], run["weights"], tiny_vl_dir)


@pytest.mark.sglang
@pytest.mark.e2e
def test_the_trainers_vision_tower_reaches_the_server_by_disk_and_by_process_group(
        vl_server, tiny_vl_dir, processor, tmp_path):
    from conftest import SGLANG_TEST_API_KEY
    from sglang_helpers import fleet_version, make_engine

    from areal_like.api.config import MicroBatchSpec
    from areal_like.api.io_struct import SaveLoadMeta
    from areal_like.runtime.weight_broadcast import WeightBroadcaster
    from engines import FSDPEngine
    from engines.fleet.updater import FleetUpdater

    trainer = FSDPEngine(VW.config(str(tiny_vl_dir), MicroBatchSpec(max_tokens_per_mb=128)))
    trainer.initialize()
    client = make_engine(vl_server.addresses, SGLANG_TEST_API_KEY,
                         weight_transport="distributed", weight_bucket_mb=0.25)
    client.set_version(fleet_version(vl_server.addresses, SGLANG_TEST_API_KEY))
    broadcaster = WeightBroadcaster(client.config)
    updater = FleetUpdater(client.config, client)  # trainer rank 0's, as in a run
    batch, _ = VW.image_batch(processor)
    prompts = [processor.prompt(VW.messages(1), [VW.noise_image(56, 56, 31)]),
               processor.prompt(VW.messages(2), [VW.noise_image(112, 56, 32), VW.noise_image(56, 56, 33)])]
    g = GenerationHyperparameters(max_new_tokens=6, temperature=1.0)
    try:
        for transport in ("disk", "distributed"):
            trainer.train_batch(batch, VW.mean_nll, VW.n_loss_tokens)  # the tower moves
            version = client.get_version() + 1
            if transport == "disk":
                meta = WeightUpdateMeta(version=version, path=str(tmp_path / f"v{version}"))
                trainer.update_weights(meta)
                updater.update_weights(meta)
                trainer.set_version(version)
            else:
                assert broadcaster.push(trainer, updater, version)["weight_sync/buckets"] > 1
            exported = tmp_path / f"reference{version}"
            trainer.save(SaveLoadMeta(path=str(exported), weight_format="hf"))
            # a folder a server starts from: the flat config SGLang reads, the image processor
            config = json.loads((exported / "config.json").read_text())
            assert config["vision_config"]["in_chans"] == 3 and "rope_scaling" in config
            assert (exported / "preprocessor_config.json").is_file()

            async def run() -> list[Any]:
                return await asyncio.gather(*(client.agenerate(ModelRequest(
                    input_ids=p.input_ids, image_data=p.image_data, gconfig=g, seed=7 + i))
                    for i, p in enumerate(prompts)))

            for prompt, reply in zip(prompts, asyncio.run(run()), strict=True):
                assert set(reply.output_versions) == {version}, transport
                expected = _reference_logprobs(exported, prompt, reply.output_tokens,
                                               processor.image_token_id)
                error = (torch.tensor(reply.output_logprobs, dtype=torch.float64) - expected)
                assert float(error.abs().max()) < LOGPROB_ATOL, transport
    finally:
        updater.close()
        broadcaster.close()
        client.destroy()
        trainer.destroy()


# ---- the synthetic visual task ------------------------------------------------------------------
def _count_blobs(png: bytes, question: str) -> int:
    from areal_like.data.shapes import COLOURS

    colour = COLOURS[question.split()[2]]
    image = load_image(png)
    todo = {(x, y) for x in range(image.width) for y in range(image.height)
            if image.getpixel((x, y)) == colour}
    blobs = 0
    while todo:
        blobs += 1
        stack = [todo.pop()]
        while stack:
            x, y = stack.pop()
            for near in ((x + 1, y), (x - 1, y), (x, y + 1), (x, y - 1)):
                if near in todo:
                    todo.remove(near)
                    stack.append(near)
    return blobs


def _colour_of(png: bytes, kind: str) -> str:
    """The colour of the one shape of `kind`: told apart by how much of its box it fills
    (square 1, circle ~0.79, triangle ~0.5)."""
    from areal_like.data.shapes import CELL, COLOURS

    image = load_image(png)
    found = {}
    for cx in (0, 1):
        for cy in (0, 1):
            pixels = [image.getpixel((x, y)) for x in range(cx * CELL, (cx + 1) * CELL)
                      for y in range(cy * CELL, (cy + 1) * CELL)]
            for name, rgb in COLOURS.items():
                xs = [i for i, p in enumerate(pixels) if p == rgb]
                if xs:
                    cols = {i // CELL for i in xs}
                    rows = {i % CELL for i in xs}
                    fill = len(xs) / (len(cols) * len(rows))
                    found[min(("square", abs(fill - 1)), ("circle", abs(fill - 0.79)),
                              ("triangle", abs(fill - 0.5)), key=lambda t: t[1])[0]] = name
    return found[kind]


def test_the_shapes_task_is_deterministic_disjoint_and_verified_exactly(processor):
    from areal_like.data.tasks import build_task

    config = DatasetConfig(type="shapes", size=64, split="train", seed=5)
    task = build_task(config)
    train, again = task.dataset, build_task(config).dataset
    test = build_task(DatasetConfig(type="shapes", size=32, split="test", seed=5)).dataset
    assert train["images"] == again["images"] and train["answer"] == again["answer"]
    pixels = {load_image(row[0]).tobytes() for row in train["images"]}
    assert not pixels & {load_image(row[0]).tobytes() for row in test["images"]}
    assert set(train["answer"]) == {"red", "green", "blue"}
    # each answer is what the picture shows
    for row in list(train)[:32]:
        kind = row["messages"][0]["content"][1]["text"].split()[-1].rstrip("?")
        assert _colour_of(row["images"][0], kind) == row["answer"]
    counting = build_task(DatasetConfig(type="shapes", size=32, seed=5,
                                        task_kwargs={"question": "count"})).dataset
    assert set(counting["answer"]) <= {"0", "1", "2", "3", "4"}
    assert len(set(counting["answer"])) >= 4
    for row in counting:
        question = row["messages"][0]["content"][1]["text"]
        assert str(_count_blobs(row["images"][0], question)) == row["answer"]
    prompt = processor.prompt(train[0]["messages"], train[0]["images"])
    assert prompt.image_grid_thw.tolist() == [[1, 4, 4]]  # 56 x 56: four image tokens
    assert task.reward_fn("", train[0]["answer"], answer=train[0]["answer"]) == 1.0
    assert task.reward_fn("", "red or blue", answer="red") == 0.0
    with pytest.raises(ValueError, match="question='size'"):
        build_task(DatasetConfig(type="shapes", size=4, task_kwargs={"question": "size"}))


@pytest.mark.sglang
@pytest.mark.e2e
def test_shapes_episodes_cross_the_rollout_process_and_train_on_what_the_server_saw(
        vl_server, tiny_vl_dir):
    from conftest import SGLANG_TEST_API_KEY
    from sglang_helpers import fleet_version

    from areal_like.api.config import MicroBatchSpec, RewardConfig
    from areal_like.data.shapes import load_shapes
    from areal_like.rewards import exact_match_reward
    from areal_like.rollout.process import RolloutProcess
    from areal_like.rollout.service import RolloutSetup
    from engines import FSDPEngine
    from workflows import VisionRLVRWorkflow

    config = rollout_config(server_addrs=list(vl_server.addresses), api_key=SGLANG_TEST_API_KEY,
                           seed=3, consumer_batch_size=2)
    process = RolloutProcess(RolloutSetup(rollout=config, reward=RewardConfig(max_workers=1)))
    process.initialize()
    trainer = FSDPEngine(VW.config(str(tiny_vl_dir), MicroBatchSpec(max_tokens_per_mb=256)))
    try:
        # the fleet back on the folder's weights, which the trainer starts from
        version = fleet_version(vl_server.addresses, SGLANG_TEST_API_KEY) + 1
        process.set_version(version - 1)
        process.update_weights(WeightUpdateMeta.from_disk(str(tiny_vl_dir), version))
        items = list(load_shapes(4, "train", seed=11))
        workflow = VisionRLVRWorkflow(exact_match_reward, GenerationHyperparameters(
            n_samples=2, max_new_tokens=4, temperature=1.0), str(tiny_vl_dir))
        batch = process.prepare_batch([items[:2], items[2:]], workflow, timeout=300)
        assert batch.batch_size[0] == 4  # 2 groups x 2 samples, one picture per group
        assert batch["pixel_values"].is_shared()  # images through shared memory too
        assert batch["image_grid_thw"].tolist() == [[[1, 4, 4]]] * 4
        assert batch["pixel_values"].shape == (4, 16, 3 * 2 * 14 * 14)
        groups = batch["group_id"].tolist()
        assert groups[0] == groups[1] != groups[2] == groups[3]
        assert torch.equal(batch["pixel_values"][0], batch["pixel_values"][1])
        assert not torch.equal(batch["pixel_values"][1], batch["pixel_values"][2])
        assert set(batch["versions"][batch["loss_mask"]].tolist()) == {version}
        # the trainer, on the same weights, gives the sampled tokens the server's log-probs:
        # the same pixels, image tokens and positions on both sides
        trainer.initialize()
        recomputed = trainer.forward(batch)
        mask = torch.zeros_like(batch["loss_mask"])
        mask[:, :-1] = batch["loss_mask"][:, 1:]  # forward's log-prob at t is for token t + 1
        gap = (recomputed[mask] - batch["logprobs"][batch["loss_mask"]]).abs().max()
        assert float(gap) < LOGPROB_ATOL
    finally:
        trainer.destroy()
        process.destroy()


@pytest.mark.sglang
@pytest.mark.e2e
def test_grpo_recipe_trains_on_the_shapes_task_with_images(vl_server, tiny_vl_dir, tmp_path):
    from test_recipes import SMALL, _run_recipe

    records = _run_recipe(
        "grpo", vl_server, tiny_vl_dir, tmp_path, *SMALL, "gconfig.n_samples=4",
        "train_dataset.type=shapes", "valid_dataset.type=shapes", "valid_dataset.split=test",
        "rollout.workflow=workflows.vision_rlvr:VisionRLVRWorkflow")
    assert [r["step"] for r in records] == [0, 1, 2]
    last = records[-1]
    assert last["update_successful"] == 1.0 and last["rollout/version"] >= 1
    # evaluation ran the trained workflow class, with the items' images, on every item
    assert records[0]["eval/n"] == last["eval/n"] == 4.0
    assert records[0]["eval/reward_failed"] == 0.0
    # the pushed weights are a folder a server starts from (flat config, image processor)
    (pushed,) = tmp_path.glob("*/trial0/weights/v2")
    assert json.loads((pushed / "config.json").read_text())["vision_config"]["in_chans"] == 3
    assert (pushed / "preprocessor_config.json").is_file()


@pytest.mark.sglang
@pytest.mark.e2e
def test_ppo_on_step_rewards_of_a_prm_that_sees_the_picture(vl_server, tiny_vl_dir, tmp_path):
    from test_prm_recipe import PRM_ARGS
    from test_recipes import _run_recipe

    from areal_like.rewards.vision_prm import build_vision_prm

    prm_dir = build_vision_prm(tmp_path / "prm", tiny_vl_dir, seed=2)
    records = _run_recipe(
        "ppo_prm", vl_server, tiny_vl_dir, tmp_path / "logs", *PRM_ARGS,
        f"prm.model_path={prm_dir}", "rollout.workflow=workflows.vision_prm:VisionPRMWorkflow",
        "train_dataset.type=shapes", "+train_dataset.task_kwargs.question=count",
        "valid_dataset.type=shapes", "+valid_dataset.task_kwargs.question=count",
        "valid_dataset.split=test", "actor.freeze_vision_tower=true",
        "critic.freeze_vision_tower=true")
    assert [r["step"] for r in records] == [0, 1, 2]
    last = records[-1]
    assert last["update_successful"] == 1.0 and last["rollout/version"] >= 1
    # the value head trained on the pictures' rows; evaluation ran the RLVR class with images
    assert "critic/loss" in last and records[0]["eval/n"] == 4.0
    assert records[0]["eval/reward_failed"] == 0.0
    # PRM step rewards (score - 0.5 per step, at most 8 steps), never the verifier's 0/1. The
    # service answers 400 to a prompt with an image pad and no image (test_vision_prm.py), so
    # the steps were scored with the pictures.
    for r in records[1:]:
        assert -4.0 <= r["actor/task_reward/avg"] <= 4.0
        assert r["actor/task_reward/avg"] != round(r["actor/task_reward/avg"])
        assert r["rollout/failed_reward_total"] == 0.0


def test_a_completion_ends_at_a_vision_token_which_is_left_out(processor, tiny_vl_dir):
    from areal_like.api.io_struct import ModelResponse
    from areal_like.rewards import exact_match_reward
    from workflows.vision_rlvr import VisionRLVRWorkflow, without_vision_tail

    ids = processor.vision_token_ids
    assert processor.image_token_id in ids and len(ids) == 4
    workflow = VisionRLVRWorkflow(exact_match_reward, GenerationHyperparameters(),
                                  str(tiny_vl_dir))
    assert set(ids) <= set(workflow.gconfig.stop_token_ids)  # with EOS
    sampled = ModelResponse(input_tokens=[1, 2], output_tokens=[7, 8, processor.image_token_id],
                            output_logprobs=[-0.1, -0.2, -5.0], output_versions=[3, 3, 3])
    kept = without_vision_tail(sampled, ids)
    assert (kept.output_tokens, kept.output_logprobs, kept.output_versions) == (
        [7, 8], [-0.1, -0.2], [3, 3])
    assert kept.stop_reason == "length"  # counted as truncated
    finished = ModelResponse(input_tokens=[1, 2], output_tokens=[7, 2],
                             output_logprobs=[-0.1, -0.2], output_versions=[3, 3])
    assert without_vision_tail(finished, ids) is finished
