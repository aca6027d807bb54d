"""Per-batch rollout statistics, reported through `areal_like.utils.stats_tracker`.

Exported keys (under the caller's stats_tracker scope, then `rollout/`):
- gauges (scalar, mean over the batches since the last export): `running`, `queued`,
  `buffered`, `capacity`, `version`, `staleness_avg`, `staleness_max`,
  `episode_latency_avg_s`, `episode_latency_max_s`;
- cumulative totals (scalar): `accepted_total`, `rejected_total`, `dropped_stale_total`,
  `failed_total`, `failed_reward_total` (excluded for a failed reward), `partial_groups_total`;
- counts (summed between exports): `consumed_groups`, `consumed_sequences`,
  `staleness_hist/<k>` = number of consumed groups whose oldest trained token is k versions
  behind the version at consumption.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from tensordict import TensorDict

from areal_like.utils import stats_tracker
from areal_like.utils.batching import concat_padded

if TYPE_CHECKING:
    from areal_like.rollout.executor_state import EpisodeResult


def batch_statistics(results: list[EpisodeResult], version: int) -> dict[str, Any]:
    """Staleness histogram and latency of the groups in one consumed batch."""
    staleness = [version - r.min_version for r in results if r.min_version is not None]
    latencies = [r.latency for r in results]
    return {
        "groups": len(results),
        "version": version,
        "staleness_hist": dict(sorted(Counter(staleness).items())),
        "staleness_avg": sum(staleness) / len(staleness) if staleness else 0.0,
        "staleness_max": max(staleness, default=0),
        "episode_latency_avg_s": sum(latencies) / len(latencies) if latencies else 0.0,
        "episode_latency_max_s": max(latencies, default=0.0),
    }


def assemble_batch(
    results: list[EpisodeResult], version: int, gauges: dict[str, Any]
) -> tuple[TensorDict, dict[str, Any]]:
    """Concatenate the groups, compute and report statistics; returns (batch, statistics)."""
    batch = concat_padded([r.trajectory for r in results])
    last = batch_statistics(results, version)
    with stats_tracker.scope("rollout"):
        stats_tracker.scalar(
            running=gauges["running"], queued=gauges["queued"], buffered=gauges["buffered"],
            capacity=gauges["capacity"], version=version,
            accepted_total=gauges["accepted"], rejected_total=gauges["rejected"],
            dropped_stale_total=gauges["dropped_stale"], failed_total=gauges["failed"],
            failed_reward_total=gauges["failed_reward"],
            partial_groups_total=gauges["partial_groups"],
            staleness_avg=last["staleness_avg"], staleness_max=last["staleness_max"],
            episode_latency_avg_s=last["episode_latency_avg_s"],
            episode_latency_max_s=last["episode_latency_max_s"],
        )
        stats_tracker.add(
            consumed_groups=len(results), consumed_sequences=int(batch.batch_size[0]),
            **{f"staleness_hist/{k}": n for k, n in last["staleness_hist"].items()},
        )
    return batch, last
