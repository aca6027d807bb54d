"""One progress bar per run: the libraries' own bars (transformers' "Loading weights" and
"Writing model shards" on every weight export, datasets' "Map", the hub's downloads) are
turned off in every process that trains or evaluates."""

from __future__ import annotations

import importlib.util
import os


def silence_library_progress_bars() -> None:
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # also for child processes
    import huggingface_hub.utils
    import transformers.utils.logging

    transformers.utils.logging.disable_progress_bar()
    huggingface_hub.utils.disable_progress_bars()
    if importlib.util.find_spec("datasets") is not None:  # the engine alone does not need it
        import datasets

        datasets.disable_progress_bars()
