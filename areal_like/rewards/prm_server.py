"""An HTTP process-reward service: a token-classification PRM behind aiohttp.

    python -m areal_like.rewards.prm_server --model DIR [--host 127.0.0.1] [--port 8391]

    GET  /health                                  -> {"status": "ok", "model": DIR}
    POST /score {"prompt": str, "steps": [str]}   -> {"scores": [float, ...]}  (one per step)
         (a vision PRM folder, `rewards.vision_prm`: also "images": [base64 PNG/JPEG, ...],
          one per image pad in the prompt)

A score is p(label 1) at the step's last token (`prm_model.step_scores`). Malformed requests
get 400 naming the bad field; a model that produces a non-finite score gets 500 (never a
substitute value). Requests run one at a time in a worker thread (one CPU thread).

`PRMService` starts the server as a child process and waits, bounded, for /health.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import concurrent.futures
import json
import logging
import math
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from aiohttp import web
from transformers import AutoModelForTokenClassification, AutoTokenizer

from areal_like.models.vision import ImageInputError
from areal_like.rewards.prm_model import step_scores
from areal_like.rewards.vision_prm import VisionPRM, is_vision_prm
from areal_like.utils.network import find_free_port

logger = logging.getLogger("areal_like.prm_server")


def _parse(body: Any, sees_images: bool) -> tuple[str, list[str], list[bytes]]:
    if not isinstance(body, dict):
        raise ValueError(f"body must be a JSON object, got {type(body).__name__}")
    prompt, steps, images = body.get("prompt"), body.get("steps"), body.get("images", [])
    if not isinstance(prompt, str):
        raise ValueError(f"'prompt' must be a string, got {type(prompt).__name__}")
    if not isinstance(steps, list) or not steps or not all(isinstance(s, str) and s
                                                           for s in steps):
        raise ValueError(f"'steps' must be a non-empty list of non-empty strings, got {steps!r}")
    if images and not sees_images:
        raise ValueError("'images' given, but this PRM reads text only")
    if not isinstance(images, list) or not all(isinstance(i, str) for i in images):
        raise ValueError("'images' must be a list of base64 strings")
    try:
        return prompt, steps, [base64.b64decode(i, validate=True) for i in images]
    except binascii.Error as e:
        raise ValueError(f"'images' holds a string that is not base64: {e}") from None


def _scorer(model_dir: str) -> tuple[Callable[[str, list[str], list[bytes]], list[float]], bool]:
    """(score(prompt, steps, images), whether the PRM sees images) for a PRM folder."""
    if is_vision_prm(model_dir):
        prm = VisionPRM(model_dir).eval()
        return lambda prompt, steps, images: prm.scores(prompt, images, steps), True
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForTokenClassification.from_pretrained(model_dir).eval()
    if model.config.num_labels != 2:
        raise ValueError(f"PRM {model_dir}: num_labels={model.config.num_labels}; expected 2 "
                         "(label 1 = step correct)")
    return lambda prompt, steps, _: step_scores(model, tokenizer, prompt, steps), False


def make_app(model_dir: str) -> web.Application:
    scorer, sees_images = _scorer(model_dir)
    worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prm")

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "model": model_dir})

    async def score(request: web.Request) -> web.Response:
        try:
            prompt, steps, images = _parse(await request.json(), sees_images)
        except (ValueError, json.JSONDecodeError) as e:
            return web.json_response({"error": f"bad request: {e}"}, status=400)
        loop = asyncio.get_running_loop()
        try:
            scores = await loop.run_in_executor(worker, scorer, prompt, steps, images)
        except (ValueError, ImageInputError) as e:  # e.g. image pads and images disagree
            return web.json_response({"error": f"bad request: {e}"}, status=400)
        bad = [i for i, s in enumerate(scores) if not math.isfinite(s)]
        if bad:
            return web.json_response({"error": f"model {model_dir} produced non-finite scores "
                                      f"at steps {bad}"}, status=500)
        return web.json_response({"scores": scores})

    app = web.Application()
    app.add_routes([web.get("/health", health), web.post("/score", score)])
    app.on_shutdown.append(lambda _: asyncio.to_thread(worker.shutdown, wait=False))
    return app


class PRMService:
    """The PRM server as a child process (context manager): `url` once started."""

    def __init__(self, model_dir: str | Path, host: str = "127.0.0.1", port: int = 0,
                 startup_timeout: float = 120.0, log_path: Optional[str | Path] = None) -> None:
        self.model_dir, self.host = str(model_dir), host
        self.port = port or find_free_port(host)
        self.startup_timeout = startup_timeout
        self.log_path = Path(log_path) if log_path else None
        self.proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> PRMService:
        if not Path(self.model_dir, "config.json").exists():
            raise FileNotFoundError(f"prm.model_path={self.model_dir!r} has no config.json; "
                                    "build one with `python -m areal_like.data.prm_addition`")
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "areal_like.rewards.prm_server", "--model", self.model_dir,
             "--host", self.host, "--port", str(self.port)],
            stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"PRM server for {self.model_dir} exited with code "
                                   f"{self.proc.returncode} before {self.url}/health answered"
                                   + (f"; log: {self.log_path}" if self.log_path else ""))
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.2)  # not listening yet
        self.stop()
        raise TimeoutError(f"PRM server {self.url} ({self.model_dir}) did not answer /health "
                           f"within prm.startup_timeout={self.startup_timeout} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)

    def __enter__(self) -> PRMService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True,
                        help="PRM folder (token classification, or a vision PRM)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8391)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # shares the cores with trainer and inference servers
    logging.basicConfig(level=logging.INFO)
    web.run_app(make_app(args.model), host=args.host, port=args.port, print=None,
                access_log=None)


if __name__ == "__main__":
    main()
