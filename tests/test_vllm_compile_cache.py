"""vLLM's shared cache and a start killed mid-compile (engines/vllm/compile_cache.py), on real
folders: a start works in a cache of its own, linked from the shared one; only a start that
finished adds its entries to the shared cache, each whole; one that died adds nothing. (The
compiled vLLM starts of the launcher and Ray tests run through it.)"""

from __future__ import annotations

from pathlib import Path

from engines.vllm import compile_cache


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_only_a_finished_start_adds_to_the_shared_cache(tmp_path):
    shared = tmp_path / "cache" / "vllm"
    done = shared / "torch_compile_cache" / "torch_aot_compile" / "aaa" / "rank_0_0"
    done.mkdir(parents=True)
    (done / "model.bin").write_bytes(b"a complete artifact")
    (shared / "modelinfos.json").write_text("{}")
    before = _tree(shared)

    killed = compile_cache.private_cache(shared)
    assert killed.parent == shared.parent and _tree(killed) == before
    linked = killed / "torch_compile_cache" / "torch_aot_compile" / "aaa" / "rank_0_0"
    assert (linked / "model.bin").stat().st_ino == (done / "model.bin").stat().st_ino
    truncated = killed / "torch_compile_cache" / "torch_aot_compile" / "bbb" / "rank_0_0"
    truncated.mkdir(parents=True)
    (truncated / "model.bin").write_bytes(b"half an art")  # killed while writing
    compile_cache.discard(killed)
    assert not killed.exists() and _tree(shared) == before

    staging = shared / "torch_compile_cache" / ".ddd.1234.partial"  # another publish, under way
    staging.write_text("half of another start's entry")
    finished = compile_cache.private_cache(shared)
    assert _tree(finished) == before  # not the other publish's staging
    new = finished / "torch_compile_cache" / "torch_aot_compile" / "ccc" / "rank_0_0"
    new.mkdir(parents=True)
    (new / "model.bin").write_bytes(b"another complete artifact")
    (new / "graph.py").write_text("# compiled")
    added = compile_cache.publish(finished, shared)
    assert added == [shared / "torch_compile_cache" / "torch_aot_compile" / "ccc"]
    staging.unlink()
    assert _tree(shared) == {
        **before,
        "torch_compile_cache/torch_aot_compile/ccc/rank_0_0/graph.py": b"# compiled",
        "torch_compile_cache/torch_aot_compile/ccc/rank_0_0/model.bin":
            b"another complete artifact"}  # and none of its own staging left behind
    assert finished.exists()  # the running server may still read its own
    assert compile_cache.publish(finished, shared) == []  # nothing new a second time
    compile_cache.discard(finished)
    assert _tree(compile_cache.private_cache(shared)) == _tree(shared)  # a later start
