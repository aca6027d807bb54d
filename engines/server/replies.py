"""The backend-neutral reply types of an inference server: a parsed generation and
score, token versions, and the checks both backends' parsers share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from areal_like.api.io_struct import TokenScores
from engines.server.errors import ServerProtocolError

# SGLang's finish_reason.type -> ModelResponse.stop_reason
STOP_REASON_MAP = {"stop": "stop", "length": "length", "abort": "abort"}


# SGLang's label for weights loaded at start-up when no --weight-version was given.
DEFAULT_WEIGHT_VERSION_LABEL = "default"


def parse_version_label(label: Any, server: str) -> int:
    """Version labels are the decimal version numbers we send; SGLang's start-up label
    "default" (a server launched without --weight-version) counts as version 0."""
    if label == DEFAULT_WEIGHT_VERSION_LABEL:
        return 0
    try:
        return int(label)
    except (TypeError, ValueError):
        raise ServerProtocolError(
            f"server {server} reported weight version {label!r}; expected an integer label "
            f"(launch servers with --weight-version N and update them through this engine)"
        ) from None


def versions_from_spans(meta_info: dict[str, Any], n_tokens: int, server: str) -> list[int]:
    """One version per output token from `meta_info.weight_versions` = [{version, start, end}].

    The spans must tile [0, n_tokens) exactly; a reply without spans (older SGLang) falls back
    to the single `meta_info.weight_version` for every token.
    """
    spans = meta_info.get("weight_versions")
    if spans is None:
        if n_tokens == 0:
            return []
        if "weight_version" not in meta_info:
            raise ServerProtocolError(
                f"server {server}: reply has neither meta_info.weight_versions nor "
                f"meta_info.weight_version; cannot tell which weights produced the tokens"
            )
        return [parse_version_label(meta_info["weight_version"], server)] * n_tokens
    versions: list[int] = []
    for span in spans:
        start, end = int(span["start"]), int(span["end"])
        if start != len(versions) or end < start:
            raise ServerProtocolError(
                f"server {server}: meta_info.weight_versions {spans} do not tile the "
                f"{n_tokens} output tokens contiguously from 0"
            )
        versions.extend([parse_version_label(span["version"], server)] * (end - start))
    if len(versions) != n_tokens:
        raise ServerProtocolError(
            f"server {server}: meta_info.weight_versions {spans} cover {len(versions)} tokens "
            f"but the reply has {n_tokens} output tokens"
        )
    return versions


# A log-probability is <= 0; a float32 softmax may round a certain token up by ~1e-6.
LOGPROB_TOLERANCE = 1e-4


@dataclass
class GenerateReply:
    """One `/generate` reply, checked."""

    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    stop_reason: str
    meta_info: dict[str, Any]
    # a mixture of experts' routing as the server recorded it, flat int32 (one row per
    # forwarded position, n_moe_layers * top_k ids each); None unless asked for
    routed_experts: Optional[torch.Tensor] = None


@dataclass
class GroupReply:
    """The replies of one batched `/generate` (a prompt's samples), in request order."""

    replies: list[GenerateReply]

    @property
    def versions(self) -> list[int]:  # every generated token's, for the lost-weights check
        return [v for reply in self.replies for v in reply.versions]


def check_top_k(top_k: int) -> None:
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"score: top_k={top_k!r} must be an integer >= 0 (0: no top tokens)")


@dataclass
class ScoreReply:
    """One scoring reply, checked: per sequence, the log-probs of ids[start:] (and with top_k
    each position's k most likely tokens)."""

    scores: list[TokenScores]
    versions: list[int]  # the served version, once per scored token

    @property
    def logprobs(self) -> list[list[float]]:
        return [s.logprobs for s in self.scores]
