"""Triton's cache key stored once per installation (kernels/triton_key.py): the stored key is the one
Triton computes, it is read back while Triton's files are unchanged, and any change to them, a corrupt
or foreign file recomputes it."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tinyvllm.kernels import triton_key as tk

triton = pytest.importorskip("triton")


def test_stored_key_is_tritons_own_and_every_holder_uses_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    mod = tk._defining_module()
    assert mod is not None
    current = mod.triton_key  # Triton's, or the stored key's where an earlier test built a Triton backend
    original = getattr(current, "_tinyvllm_original", current)
    holders = [m for m in list(sys.modules.values()) if getattr(m, "triton_key", None) is current]
    for m in holders:  # Triton's own function back, undone after the test
        monkeypatch.setattr(m, "triton_key", original)
    key = tk.persist_triton_key()
    assert key == original.__wrapped__()  # Triton's function, recomputed without its lru_cache
    assert json.loads((tmp_path / tk._FILE).read_text())["key"] == key
    assert all(m.triton_key() == key and m.triton_key is not original for m in holders)
    assert tk.persist_triton_key() == key  # a second call changes nothing


def test_cached_key_reads_back_and_recomputes_on_another_stamp(tmp_path):
    store = tmp_path / "sub" / "key.json"
    calls = []

    def compute(value):
        return lambda: calls.append(value) or value

    assert tk.cached_key(store, "a", compute("K1")) == "K1"
    assert tk.cached_key(store, "a", compute("never")) == "K1" and calls == ["K1"]
    assert tk.cached_key(store, "b", compute("K2")) == "K2"  # Triton's files changed
    assert tk.cached_key(store, "b", compute("never")) == "K2"
    store.write_text("{not json")
    assert tk.cached_key(store, "b", compute("K3")) == "K3"
    store.write_text(json.dumps({"fingerprint": "b", "key": 7}))
    assert tk.cached_key(store, "b", compute("K4")) == "K4"
    assert calls == ["K1", "K2", "K3", "K4"]


def test_fingerprint_follows_every_file_triton_hashes(tmp_path):
    root = tmp_path / "triton"
    files = ["runtime/cache.py", "compiler/a.py", "backends/nvidia/b.py", "language/c.py", "_C/libtriton.so"]
    for f in files:
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        (root / f).write_text("x")
    (root / "backends/nvidia/bin").mkdir()
    (root / "backends/nvidia/bin/ptxas").write_text("not hashed by triton_key")

    def stamp(version="3.6.0"):
        return tk.fingerprint(root, str(root / "runtime/cache.py"), version)

    first = stamp()
    assert stamp() == first and stamp("3.7.0") != first
    (root / "backends/nvidia/bin/ptxas").write_text("changed, and not read by triton_key")
    assert stamp() == first
    for f in files:
        st = os.stat(root / f)
        os.utime(root / f, ns=(st.st_atime_ns, st.st_mtime_ns + 1000))
        assert stamp() != first, f
        os.utime(root / f, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert stamp() == first
    (root / "language/new.py").write_text("y")
    assert stamp() != first


def test_an_unwritable_cache_directory_still_gives_the_key(tmp_path):
    """Where the key cannot be stored (here the cache "directory" is a file), the process still gets the
    computed key, and the next one computes it again."""
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    store = blocker / "key.json"
    assert tk.cached_key(store, "a", lambda: "K") == "K"
    assert tk.cached_key(store, "a", lambda: "K2") == "K2"
