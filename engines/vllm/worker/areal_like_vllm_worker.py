"""Our methods on vLLM's worker, for what vLLM's own weight-transfer API does not do
(`--worker-extension-cls areal_like_vllm_worker.WeightFileExtension`; this folder is on the
server's PYTHONPATH), called through `/collective_rpc` (`engines/vllm/api.py`):

- `areal_like_load_from_disk`: vLLM's in-place reload of an HF folder, the folder checked
  first (vLLM's reload takes the model apart before it reads the files, and looks a missing
  folder up on the Hub), then the CPU MoE repack (`areal_like_vllm_reload`);
- `areal_like_apply_weight_file`: the delta transport's weight file (vLLM's `sparse_nccl`
  engine patches from GPU memory over NCCL; ours is a file any server can read).

The process-group transport is a vLLM weight-transfer engine of ours
(`areal_like_weight_transfer`), which importing this module registers: the worker imports
its extension before it builds its weight-transfer engine.

Runs inside the vLLM venv, so it imports only torch and vLLM. Every method returns '' or the
error as text, never raises: a refused load must leave the server serving, with the reason in
the client's error.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable

import torch
from areal_like_vllm_reload import repack_cpu_experts
from areal_like_weight_transfer import register as register_weight_transfer

register_weight_transfer()


def _reported(method: Callable[..., None]) -> Callable[..., str]:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> str:
        try:
            method(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - reported to the client, which raises it
            return f"{type(e).__name__}: {e}"
        return ""

    return call


class WeightFileExtension:
    """Methods added to vLLM's worker (`self.model_runner`, `self.rank` are the worker's)."""

    @_reported
    def areal_like_load_from_disk(self, path: str) -> None:
        """vLLM's own in-place reload of the HF folder `path`. The folder is checked first:
        vLLM's reload takes the model apart before it reads the files (a missing folder would
        leave a model that kills the worker at its next step, and would be looked up on the
        Hub)."""
        folder = Path(path)
        weights = [*folder.glob("*.safetensors"), *folder.glob("*.bin")]
        if not folder.is_dir() or not weights:
            raise FileNotFoundError(f"{path} is not a model folder with *.safetensors or *.bin "
                                    f"weights on this server's machine")
        self.reload_weights(weights_path=str(folder))  # type: ignore[attr-defined]
        repack_cpu_experts(self.model_runner.get_model())  # type: ignore[attr-defined]

    def areal_like_apply_weight_file(self, path: str, model_digest: bool = False) -> str:
        """The delta transport: apply the weight file `path` (engines/weight_transport/delta/,
        on this server's PYTHONPATH) with vLLM's in-place reload of the whole new state (a
        reload of part of a layer would leave it unloaded); the receipt as JSON."""
        import json

        import areal_like_weight_delta

        def load(changed: list[tuple[str, torch.Tensor]],
                 state: dict[str, torch.Tensor]) -> None:
            self.reload_weights(weights_iterator=iter(list(state.items())))  # type: ignore[attr-defined]
            repack_cpu_experts(self.model_runner.get_model())  # type: ignore[attr-defined]

        def digest() -> str:
            model = self.model_runner.get_model()  # type: ignore[attr-defined]
            return areal_like_weight_delta.parameters_digest(model.named_parameters())

        held = getattr(self, "_areal_like_held", None)
        if held is None:
            held = areal_like_weight_delta.HeldWeights()
            self._areal_like_held = held

        def fingerprint() -> str:
            model = self.model_runner.get_model()  # type: ignore[attr-defined]
            return areal_like_weight_delta.model_fingerprint(model.named_parameters())

        receipt = held.apply_file(path, load, digest if model_digest else None, fingerprint)
        return json.dumps(receipt)
