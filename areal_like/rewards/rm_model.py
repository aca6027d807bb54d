"""Outcome reward models as Hugging Face folders: written by `recipes.rm`, checked and scored
here (by `rm_server --model`, `areal-like eval`).

A reward-model folder is a sequence-classification model with one output (`num_labels=1`,
`AutoModelForSequenceClassification`, as TRL's and OpenRLHF's reward models are): its score of
prompt + response is the head's output at the last token. The trainer's scalar head is a
token-classification head (one value per token, the critic's); `export_reward_model` turns
its folder into the sequence-classification layout. That head's bias is dropped: the
pairwise loss only sees differences of rewards, so a constant shift of every score is
neither learned nor part of the model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SEQUENCE_HEAD = "ForSequenceClassification"
TOKEN_HEAD = "ForTokenClassification"
# what token-classification heads are called in transformers (the sequence head: `score`)
TOKEN_HEAD_NAMES = ("score", "classifier")


def export_reward_model(folder: Path) -> None:
    """Rewrite a scalar-head (token-classification) HF folder as a sequence-classification
    reward model, in place."""
    from safetensors.torch import load_file, save_file

    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    arch = config.get("architectures") or []
    if len(arch) != 1 or not arch[0].endswith(TOKEN_HEAD) or config.get("num_labels", 1) != 1:
        raise ValueError(f"{folder}: architectures={arch}; expected one "
                         f"*{TOKEN_HEAD} with a single output (a critic engine's export)")
    config["architectures"] = [arch[0].removesuffix(TOKEN_HEAD) + SEQUENCE_HEAD]
    renamed: dict[str, str] = {}
    for name in sorted(folder.glob("*.safetensors")):
        tensors = load_file(str(name))
        kept = {}
        for key, tensor in tensors.items():
            head, _, part = key.rpartition(".")
            if head in TOKEN_HEAD_NAMES and part == "bias":
                continue  # the constant the pairwise loss never sees
            if head in TOKEN_HEAD_NAMES:  # e.g. GPT-2's `classifier` is `score` here
                renamed[key] = f"score.{part}"
            kept[renamed.get(key, key)] = tensor
        if kept.keys() != tensors.keys():
            save_file(kept, str(name), metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {renamed.get(k, k): v for k, v in data["weight_map"].items()
                              if not (k.rpartition(".")[0] in TOKEN_HEAD_NAMES
                                      and k.endswith(".bias"))}
        index.write_text(json.dumps(data, indent=2))
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    _check_loads_whole(folder)


def _check_loads_whole(folder: Path) -> None:
    """The exported folder loads as a sequence classifier with every weight its own (a head
    left to random initialisation would score nothing the trainer learned)."""
    from transformers import AutoModelForSequenceClassification

    _, info = AutoModelForSequenceClassification.from_pretrained(str(folder),
                                                                 output_loading_info=True)
    if info["missing_keys"]:
        raise RuntimeError(f"{folder}: the exported reward model lacks "
                           f"{sorted(info['missing_keys'])} (its architecture names its score "
                           f"head otherwise)")


def check_reward_model_folder(folder: str) -> None:
    """Raise naming the folder and its head unless it is a one-output reward model."""
    config_file = Path(folder) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{folder} is not a Hugging Face model folder (no config.json)")
    config = json.loads(config_file.read_text())
    arch = config.get("architectures") or []
    labels = len(config["id2label"]) if "id2label" in config else config.get("num_labels", 2)
    if len(arch) != 1 or not arch[0].endswith(SEQUENCE_HEAD) or labels != 1:
        hint = (" (a causal LM: a policy, not a reward model)" if arch and
                arch[0].endswith("ForCausalLM") else "")
        raise ValueError(f"{folder}: architectures={arch}, num_labels={labels}{hint}; a reward "
                         f"model has a one-output sequence-classification head "
                         f"(*{SEQUENCE_HEAD}, num_labels=1), as `recipes.rm` writes it")


def is_reward_model_folder(folder: str) -> bool:
    config_file = Path(folder) / "config.json"
    if not config_file.is_file():
        return False
    arch = json.loads(config_file.read_text()).get("architectures") or []
    return len(arch) == 1 and arch[0].endswith(SEQUENCE_HEAD)


class RewardModel:
    """A reward-model folder loaded for scoring (CPU by default, eval mode, no gradients)."""

    def __init__(self, folder: str, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 batch_size: int = 16) -> None:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        check_reward_model_folder(folder)
        self.folder, self.device, self.batch_size = folder, torch.device(device), batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            folder, dtype=dtype).to(self.device).eval()
        text = self.model.config.get_text_config()
        self.context = int(getattr(text, "max_position_embeddings", 0) or 0)

    def token_ids(self, prompt: str, response: str) -> list[int]:
        """prompt and response tokenised apart, as `recipes.rm` trained on them."""
        return (self.tokenizer.encode(prompt, add_special_tokens=False)
                + self.tokenizer.encode(response, add_special_tokens=False))

    @torch.no_grad()
    def score_ids(self, sequences: list[list[int]]) -> list[float]:
        """The score (head output at the last token) of each token sequence."""
        scores: list[float] = []
        for start in range(0, len(sequences), self.batch_size):
            chunk = sequences[start:start + self.batch_size]
            too_long = [len(s) for s in chunk if self.context and len(s) > self.context]
            if too_long or not all(chunk):
                raise ValueError(f"a sequence of {too_long[0] if too_long else 0} tokens: the "
                                 f"reward model {self.folder} reads 1..{self.context}")
            width = max(map(len, chunk))
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros(len(chunk), width, dtype=torch.long)
            for i, seq in enumerate(chunk):  # right padding: the last real token is len - 1
                ids[i, :len(seq)], mask[i, :len(seq)] = torch.tensor(seq), 1
            hidden = self.model.base_model(input_ids=ids.to(self.device),
                                           attention_mask=mask.to(self.device)).last_hidden_state
            last = hidden[torch.arange(len(chunk)), torch.tensor([len(s) - 1 for s in chunk])]
            scores += self.model.score(last).float().reshape(-1).tolist()
        return scores

    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        return self.score_ids([self.token_ids(p, r) for p, r in zip(prompts, responses,
                                                                     strict=True)])

