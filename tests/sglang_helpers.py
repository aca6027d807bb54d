"""Shared pieces of the real-server tests (SGLang and vLLM fleets): engine factory, HF
reference log-probs, weight copies."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import socket
import urllib.request
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest
import torch
from config_helpers import rollout_config
from transformers import AutoModelForCausalLM

from areal_like.rollout.controller import RolloutController
from engines.fleet.client import RemoteInferenceEngine
from engines.fleet.launch import InferenceFleet

# SGLang computes in float32; the reference runs the same weights in float64. Measured max
# |diff| on the 1m model is ~1e-6; 1e-4 leaves room for float32 reduction-order noise.
LOGPROB_ATOL = 1e-4


# Attempts to land a pause or an update inside one generation. On vLLM the tiny model's 800
# tokens take ~0.1-0.3 s in the engine; beside two busy processes about one attempt in four
# landed (4 of 15, with the tests' delay search), so 6 attempts failed now and then; 20 do not
# (0.75^20 ~ 0.3 %). An attempt that lands ends the loop.
WINDOW_ATTEMPTS = 20


SHIM_DIR = Path(__file__).resolve().parents[1] / "engines" / "sglang" / "shim"


def load_shim(name: str) -> Any:
    """One of the SGLang shim's modules (engines/sglang/shim/`name`.py), loaded from its file
    into this process: its pieces are plain torch, checked here against references."""
    spec = importlib.util.spec_from_file_location(name, SHIM_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def require_sglang_venv() -> None:
    """Skip when the SGLang venv is missing (fail in CI), like the `sglang_fleet` fixture."""
    from engines.fleet.launch import resolve_server_python
    from engines.server.errors import ServerStartError

    try:
        resolve_server_python(".venv-sglang")
    except ServerStartError as e:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI must run the SGLang tests: {e}")
        pytest.skip(f"SGLang venv missing (run `make sglang`): {e}")


def make_engine(addresses: list[str], api_key: str | None,
                **config: object) -> RemoteInferenceEngine:
    """A client of the fleet at `addresses` (`backend="vllm"` among `config` for vLLM's)."""
    engine = RemoteInferenceEngine(rollout_config(server_addrs=list(addresses), api_key=api_key,
                                                 **config))  # type: ignore[arg-type]
    engine.initialize()
    return engine


def fleet_engine(fleet: InferenceFleet, **config: object) -> RemoteInferenceEngine:
    """A client of `fleet`, whichever its backend."""
    return make_engine(fleet.addresses, fleet.api_key, backend=fleet.config.backend, **config)


def make_controller(addresses: list[str], api_key: str | None,
                    **config: object) -> RolloutController:
    """A real fleet client with the executor that runs workflows on it (in this process)."""
    rollout = rollout_config(server_addrs=list(addresses), api_key=api_key,
                            **config)  # type: ignore[arg-type]
    controller = RolloutController(rollout, RemoteInferenceEngine(rollout))
    controller.initialize()
    return controller


@lru_cache(maxsize=4)
def _reference_model(model_dir: str) -> torch.nn.Module:
    # a mixture of experts' fused experts run per expert (the default kernel has no float64)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64,
                                                 experts_implementation="eager")
    return model.eval()


def hf_logprobs(
    model_dir: str | Path, prompt: list[int], output: list[int],
    banned_token_ids: tuple[int, ...] = (),
) -> torch.Tensor:
    """float64 log p(output[i] | prompt + output[:i]) from an independent HF forward pass.

    `banned_token_ids` get probability 0 before normalising: SGLang reports the log-probs of
    the distribution it sampled from, and under `min_new_tokens` that one excludes EOS.
    """
    logp = hf_next_token_logprobs(model_dir, prompt, output, banned_token_ids)
    return logp.gather(-1, torch.tensor(output)[:, None])[:, 0]


def hf_next_token_logprobs(
    model_dir: str | Path, prompt: list[int], output: list[int],
    banned_token_ids: tuple[int, ...] = (),
) -> torch.Tensor:
    """float64 [len(output), V]: log p(. | prompt + output[:i]), the whole next-token
    distribution at each output position (independent HF forward)."""
    model = _reference_model(str(model_dir))
    ids = torch.tensor([list(prompt) + list(output)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    logits = logits[len(prompt) - 1 : -1]
    if banned_token_ids:
        logits[:, list(banned_token_ids)] = float("-inf")
    return torch.log_softmax(logits, dim=-1)


def eos_token_id(model_dir: str | Path) -> int:
    return int(AutoModelForCausalLM.from_pretrained(model_dir).config.eos_token_id)


def perturbed_copy(src: Path, dst: Path, seed: int, scale: float = 0.05) -> Path:
    """`src`'s model with every weight shifted by `scale`·N(0,1) noise, saved to `dst`."""
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    model.save_pretrained(dst)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    return dst


def fleet_version(addresses: list[str], api_key: str | None, backend: str = "sglang") -> int:
    """The weight version every server of the fleet reports (they must agree)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    versions = {_server_version(addr, headers, backend) for addr in addresses}
    assert len(versions) == 1, f"servers disagree on the weight version: {versions}"
    return versions.pop()


def restore_session_fleet(fleet: InferenceFleet, model_dir: str | Path) -> int:
    """Every server back on the session weights under one fresh version, loaded server by
    server (a test that left one server behind, or a load that failed, must not leave the
    fleet disagreeing for the next test). Returns that version."""
    from areal_like.api import WeightUpdateMeta

    backend = fleet.config.backend
    headers = {"Authorization": f"Bearer {fleet.api_key}"} if fleet.api_key else {}
    version = max(_server_version(a, headers, backend) for a in fleet.addresses) + 1
    for addr in fleet.addresses:
        engine = make_engine([addr], fleet.api_key, backend=backend)
        try:
            engine.update_weights(WeightUpdateMeta.from_disk(str(model_dir), version))
            assert engine.in_service() == [addr], f"{addr} could not load {model_dir}"
        finally:
            engine.destroy()
    assert fleet_version(fleet.addresses, fleet.api_key, backend) == version
    return version


def reset_fleet(fleet: InferenceFleet, model_dir: str | Path) -> None:
    """The fleet as freshly started servers are: `model_dir`'s weights labelled version 0,
    loaded through the project's own update path (a client that also continues a server a
    killed trainer left paused), every server agreeing."""
    from areal_like.api import WeightUpdateMeta

    engine = fleet_engine(fleet)
    try:
        engine.update_weights(WeightUpdateMeta.from_disk(str(model_dir), 0))
        assert engine.in_service() == fleet.addresses, engine.in_service()
    finally:
        engine.destroy()
    assert fleet_version(fleet.addresses, fleet.api_key, fleet.config.backend) == 0


def revive_spare(fleet: InferenceFleet, model_dir: str | Path) -> None:
    """A one-server fleet that a test may have killed, as new: restarted if it is dead,
    then `model_dir`'s weights under version 0 (`reset_fleet`)."""
    if fleet.dead_servers():
        fleet.kill_server(0)  # whatever of its process group is left
        fleet.restart_server(0)
        fleet.wait_healthy(fleet.config.startup_timeout)
    reset_fleet(fleet, model_dir)


def attach_args(fleet: InferenceFleet) -> list[str]:
    """Overrides that make a recipe or the launcher use `fleet` instead of starting servers."""
    return [f"rollout.server_addrs=[{','.join(fleet.addresses)}]",
            f"rollout.client.api_key={fleet.api_key}", f"server.backend={fleet.config.backend}"]


def _server_version(addr: str, headers: dict[str, str], backend: str = "sglang") -> int:
    path = "/weight_info" if backend == "vllm" else "/get_model_info"
    req = urllib.request.Request(f"http://{addr}{path}", headers=headers)
    with urllib.request.urlopen(req, timeout=10) as resp:
        label = json.load(resp)["weight_version"]
    return 0 if label == "default" else int(label)


def server_pgid(port: int) -> int:
    """The process group of the SGLang or vLLM server listening on `port` (a server started
    under this test process, by command or forked from the SGLang zygote)."""
    for pid, _, listening in listening_sockets(os.getpid()):
        if listening == port:
            with contextlib.suppress(ProcessLookupError):  # a server that died meanwhile
                return os.getpgid(pid)
    raise LookupError(f"no server process under this test listens on port {port}")


def process_tree(root: int) -> list[int]:
    """`root` and every process under it."""
    seen, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.append(pid)
        for task in Path(f"/proc/{pid}/task").glob("*"):
            with contextlib.suppress(OSError):
                todo += [int(c) for c in (task / "children").read_text().split()]
    return seen


def processes_running_module(root: int, module: str) -> list[int]:
    """The processes under `root` started as `python -m <module>` (e.g. torchrun's ranks)."""
    found = []
    for pid in process_tree(root):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        # the first `-m` is the process's own (a launcher may name the module later on)
        first = args.index(b"-m") if b"-m" in args else len(args)
        if args[first + 1:first + 2] == [module.encode()]:
            found.append(pid)
    return found


def _decode_address(hexaddr: str) -> tuple[str, int]:
    ip, port = hexaddr.split(":")
    raw = bytes.fromhex(ip)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1]), int(port, 16)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))  # 32-bit words, host order
    return socket.inet_ntop(socket.AF_INET6, raw), int(port, 16)


def listening_sockets(root: int) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every listening TCP socket of `root` and its descendants,
    from /proc (LISTEN = state 0A in /proc/<pid>/net/tcp{,6}, matched by socket inode)."""
    found = []
    for pid in process_tree(root):
        table = {}
        for name in ("tcp", "tcp6"):
            try:
                lines = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
            except OSError:
                continue
            for line in lines:
                fields = line.split()
                if fields[3] == "0A":
                    table[int(fields[9])] = _decode_address(fields[1])
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:[") and int(target[8:-1]) in table:
                found.append((pid, *table[int(target[8:-1])]))
    return sorted(set(found))


# The servers' float32 log-probs of the same tokens can differ in their last bits from one run
# to the next (seen: one token in a run, ~1e-8 relative; the tokens themselves are identical).
# Statistics made from them against the trainer's (behav_*, and the train/inference gap:
# seen 2026-12-02, |diff| ~3e-8) are compared to this tolerance, every other logged value bit
# for bit.
SERVER_LOGPROB_KEYS = ("actor/update/behav_", "actor/gap/")
SERVER_LOGPROB_ATOL = 1e-6


def assert_same_records(a: list[dict], b: list[dict]) -> None:
    """Two runs' metric records are equal: bit for bit, except the server-log-prob statistics
    (`SERVER_LOGPROB_KEYS`, within `SERVER_LOGPROB_ATOL`)."""
    assert len(a) == len(b), (len(a), len(b))
    for step, (ra, rb) in enumerate(zip(a, b, strict=True)):
        assert ra.keys() == rb.keys(), (step, sorted(set(ra) ^ set(rb)))
        noisy = [k for k in ra if k.startswith(SERVER_LOGPROB_KEYS)]
        far = {k: (ra[k], rb[k]) for k in noisy if abs(ra[k] - rb[k]) > SERVER_LOGPROB_ATOL}
        assert not far, (step, far)
        exact_a = {k: v for k, v in ra.items() if k not in noisy}
        exact_b = {k: v for k, v in rb.items() if k not in noisy}
        differ = {k: (v, exact_b[k]) for k, v in exact_a.items() if v != exact_b[k]}
        assert not differ, (step, differ)
