"""The engines' old public names and paths keep working after the move to engines/{fleet,
server,sglang,vllm,weight_transport,fsdp} (each is listed in docs/migrating_from_arealite.md),
and the backend-neutral packages name no backend in their classes."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("old", "new"), [
    ("engines:SGLangFleet", "engines.fleet.launch:InferenceFleet"),
    ("engines.sglang_server:SGLangFleet", "engines.fleet.launch:InferenceFleet"),
    ("engines.sglang_server:SGLangServerError", "engines.server.errors:ServerStartError"),
    ("engines.sglang_server:resolve_sglang_python", "engines.fleet.launch:resolve_server_python"),
    ("engines.remote_engine:RemoteSGLangEngine", "engines.fleet.client:RemoteSGLangEngine"),
    ("engines.remote_engine:RemoteInferenceEngine", "engines.fleet.client:RemoteInferenceEngine"),
    ("engines.remote_engine:RemoteSGLangError", "engines.server.errors:InferenceServerError"),
    ("engines.remote_engine:SGLangProtocolError", "engines.server.errors:ServerProtocolError"),
    ("engines:RemoteSGLangEngine", "engines.fleet.client:RemoteSGLangEngine"),
    ("engines.fsdp_engine:FSDPEngine", "engines.fsdp.engine:FSDPEngine"),
    ("engines:FSDPEngine", "engines.fsdp.engine:FSDPEngine"),
    ("areal_like.api.config:SGLangServerConfig", "areal_like.api.config:ServerConfig"),
])
def test_an_old_name_is_the_new_object(old: str, new: str) -> None:
    import importlib

    def load(spec: str) -> object:
        module, name = spec.split(":")
        return getattr(importlib.import_module(module), name)

    assert load(old) is load(new)


def test_the_old_serve_entry_point_runs() -> None:
    out = subprocess.run([sys.executable, "-m", "engines.sglang_serve", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--model-path" in out.stdout and "--backend" in out.stdout


async def test_an_old_server_error_name_catches_a_refused_control_call() -> None:
    import aiohttp

    from areal_like.utils.network import find_free_port
    from engines.remote_engine import RemoteSGLangError
    from engines.server.http import post_json

    addr = f"127.0.0.1:{find_free_port()}"  # nothing listens there
    async with aiohttp.ClientSession() as session:
        with pytest.raises(RemoteSGLangError, match=f"inference server {addr}: /pause_generation"):
            await post_json(session, addr, "/pause_generation", {}, timeout=10.0, retries=0)


@pytest.mark.parametrize("package", ["fleet", "server", "weight_transport"])
def test_a_backend_neutral_package_names_no_backend(package: str) -> None:
    offenders = []
    for path in sorted((ROOT / "engines" / package).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    b in node.name for b in ("SGLang", "VLLM", "Vllm")) \
                    and node.name not in {"RemoteSGLangEngine", "RemoteVLLMEngine"}:
                offenders.append(f"{path.name}:{node.lineno} {node.name}")
    assert not offenders, offenders
