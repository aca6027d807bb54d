"""`areal-like eval` of a reward-model folder: its pair accuracy on held-out preference pairs.

    areal-like eval RUN/final [--config FILE] [valid_pairs.KEY=VALUE ...]

The pairs are the config's `valid_pairs` (the run's own `config.yaml` by default), its first
`evaluation.n_prompts`, scored as the rm recipe's evaluation scores them: the reward of
prompt + response at the last token; accuracy is the share of pairs with r(chosen) >
r(rejected). In this process, on the CPU: a reward model needs no inference server.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from areal_like.api.config_loader import ConfigError
from areal_like.api.preference_config import PreferenceDataConfig
from areal_like.data.preference import load_pairs
from areal_like.rewards.rm_model import RewardModel
from areal_like.utils.chat import set_chat_template_kwargs


def valid_pairs_config(config: Any, config_path: Path, overrides: list[str]
                       ) -> PreferenceDataConfig:
    """The `valid_pairs` section: of the recipe's schema when the YAML names one, else read
    from the (resolved) run config, with `valid_pairs.*` overrides applied."""
    section = getattr(config, "valid_pairs", None)
    if isinstance(section, PreferenceDataConfig):
        return section
    loaded = OmegaConf.load(config_path)
    raw = loaded.get("valid_pairs") if isinstance(loaded, DictConfig) else None
    if raw is None:
        raise ConfigError(f"{config_path} has no valid_pairs section: evaluating a reward model "
                          f"needs held-out pairs (give --config of an rm recipe YAML, e.g. "
                          f"recipes/conf/rm_addition.yaml)")
    mine = [o.lstrip("+") for o in overrides if o.lstrip("+").startswith("valid_pairs.")]
    try:
        merged = OmegaConf.merge(OmegaConf.structured(PreferenceDataConfig), raw,
                                 OmegaConf.from_dotlist(mine).get("valid_pairs", {}))
        made = OmegaConf.to_object(merged)
    except (OmegaConfBaseException, ValueError) as e:
        raise ConfigError(f"{config_path} valid_pairs: {e}") from None
    assert isinstance(made, PreferenceDataConfig)
    return made


def evaluate_reward_model(model_dir: Path, pairs: PreferenceDataConfig, n_pairs: int,
                          chat_template_kwargs: dict[str, Any]) -> dict[str, float]:
    """`eval/pair_accuracy` and `eval/reward_margin` (mean r(chosen) - r(rejected)); chat
    prompts rendered with the run's `model.chat_template_kwargs`, as training rendered them."""
    try:
        model = RewardModel(str(model_dir))
    except ValueError as e:  # not a reward model: its head named
        raise ConfigError(str(e)) from None
    set_chat_template_kwargs(model.tokenizer, chat_template_kwargs)
    try:
        held_out = load_pairs(pairs, model.tokenizer, model.model.config, "valid_pairs",
                              add_eos=False)[:n_pairs]
    except ValueError as e:
        raise ConfigError(str(e)) from None
    sequences = [p.prompt_ids + ids for p in held_out for ids in (p.chosen_ids, p.rejected_ids)]
    scores = model.score_ids(sequences)
    margins = [c - r for c, r in zip(scores[0::2], scores[1::2], strict=True)]
    return {"eval/pair_accuracy": sum(m > 0 for m in margins) / len(margins),
            "eval/reward_margin": sum(margins) / len(margins),
            "eval/n_pairs": float(len(margins))}
