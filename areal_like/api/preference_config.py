"""The sections of the preference recipes (reward-model training, DPO): their pairs and losses."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict

from areal_like.api.config_checks import (
    FRACTION_BELOW_1,
    above,
    at_least,
    bounded,
    check,
    check_bounds,
    choices,
)

PAIR_TYPES = ("addition_pairs", "file")


@dataclass
class PreferenceDataConfig:
    """Preference pairs: (prompt, chosen, rejected[, margin]) rows.

    `file`: `path` is a .jsonl / .json / .parquet file, or a folder that HF `datasets` reads
    (written by `save_to_disk`, or in the Hub's layout: data files under it, a README's
    configs); `split` picks the folder's split. A row's `prompt` is a string or a list of chat
    messages (rendered with the model's chat template); `chosen` / `rejected` are strings or
    a list holding the one assistant message (TRL's conversational format); an optional
    `margin` (a number) asks the reward model for r(chosen) - r(rejected) >= margin.
    `addition_pairs`: generated from the addition task (the main job's prompts): the right
    sum against a wrong answer: one digit changed, a near miss, digits swapped, or a digit
    added or dropped (`task_kwargs.num_digits`, 2)."""

    type: str = bounded("addition_pairs", bound=choices(*PAIR_TYPES))
    path: str = ""  # type=file: the file or dataset folder
    split: str = "train"  # a folder's split; addition_pairs: the task's train / test problems
    size: int = bounded(2000, bound=at_least(0, " (0: every row of a file)"))
    seed: int = 1
    batch_size: int = bounded(32, bound=at_least(1))  # pairs per optimizer step
    shuffle: bool = True
    # tokens of prompt + response (DPO: + EOS); a longer pair is an error naming its row;
    # also bounded by the model's max_position_embeddings
    max_length: int = bounded(512, bound=at_least(2))
    task_kwargs: Dict[str, Any] = field(default_factory=dict)  # addition_pairs: num_digits

    def __post_init__(self) -> None:
        check_bounds(self, "PreferenceDataConfig")
        check("PreferenceDataConfig", "path", bool(self.path) == (self.type == "file"),
              self.path, "a file or folder for type=file" if self.type == "file" else
              "unset: type=addition_pairs generates its pairs")
        check("PreferenceDataConfig", "size", self.size >= 1 or self.type == "file", self.size,
              ">= 1 (0 = every row, for type=file only)")
        unknown = sorted(set(self.task_kwargs) - ({"num_digits"} if self.type ==
                                                   "addition_pairs" else set()))
        check("PreferenceDataConfig", "task_kwargs", not unknown, dict(self.task_kwargs),
              "num_digits (type=addition_pairs) and nothing else")


@dataclass
class RewardModelLossConfig:
    """Bradley-Terry: loss = -log sigmoid(r(chosen) - r(rejected) - margin), margin from the
    pair's `margin` column (0 without one) times `margin_scale` (0: margins ignored). The loss
    sees reward differences only: no term trains the head's bias (which the exported reward
    model does not keep), so a reward-centring term is not offered."""

    margin_scale: float = bounded(1.0, bound=at_least(0))

    def __post_init__(self) -> None:
        check_bounds(self, "RewardModelLossConfig")


@dataclass
class DPOLossConfig:
    """Direct preference optimisation against a frozen reference (log-ratios h = (log pi(y_c)
    - log ref(y_c)) - (log pi(y_r) - log ref(y_r)), sums over the response tokens and EOS).

    sigmoid: -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h) (eps = label_smoothing,
    the conservative DPO of noisy labels); ipo: (h' - 1 / (2 beta))^2 with h' the same ratio
    of per-token mean log-probs (IPO's length-normalised form, as TRL computes it)."""

    beta: float = bounded(0.1, bound=above(0))
    loss_type: str = bounded("sigmoid", bound=choices("sigmoid", "ipo"))
    label_smoothing: float = bounded(0.0, bound=FRACTION_BELOW_1)
    # + coef * NLL of the chosen responses (each one's per-token mean, then the mean over the
    # pairs; TRL's rpo_alpha takes the mean over all chosen tokens): RPO's regulariser; 0: off
    sft_coef: float = bounded(0.0, bound=at_least(0))

    def __post_init__(self) -> None:
        check_bounds(self, "DPOLossConfig")
        check("DPOLossConfig", "label_smoothing",
              self.label_smoothing == 0 or self.loss_type == "sigmoid", self.label_smoothing,
              "0 with loss_type=ipo (label smoothing is a sigmoid-loss variant)")
        check("DPOLossConfig", "label_smoothing", self.label_smoothing < 0.5,
              self.label_smoothing, "< 0.5 (at 0.5 chosen and rejected are the same label)")
