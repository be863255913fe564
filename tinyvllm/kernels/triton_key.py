"""Triton's own cache key, computed once per installation instead of once per process.

Triton keys every compiled kernel by `triton_key()`: the SHA-256 of its frontend and compiler sources and
of its whole native library (libtriton, hundreds of MB), computed at the first kernel launch of each
process (docs/perf.md §12 gives its cost), even when every kernel then comes from the warm cache.
`persist_triton_key()` stores the key beside Triton's cache, under a fingerprint of what it hashes:
Triton's version and, for every file it reads, the path, size, modification time and inode. A process
whose fingerprint matches reads the key back (a few ms of `stat` calls); any changed, added or removed
file recomputes it with Triton's own function. The key then replaces `triton_key` in the modules that
hold it, as Triton's own compile-pool workers do (`triton._compile_warmup_pool`), so every cache lookup
sees the same string Triton would compute.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

_FILE = "tinyvllm_triton_key.json"
_HASHED_DIRS = ("compiler", "backends", "language")  # what triton_key reads, besides its own module and _C


def _defining_module():
    """The module that defines Triton's `triton_key` (runtime.cache in recent versions, compiler.compiler
    before; its function may be the stored key's already), or None for a Triton without one."""
    import importlib

    for name in ("triton.runtime.cache", "triton.compiler.compiler"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        fn = getattr(mod, "triton_key", None)
        if fn is not None and (getattr(fn, "__module__", None) == name or hasattr(fn, "_tinyvllm_original")):
            return mod
    return None


def fingerprint(triton_dir: Path, key_module_file: str, version: str) -> str:
    """SHA-256 over Triton's version and (relative path, size, mtime, inode) of every file `triton_key`
    reads: its own module, the Python files under compiler/, backends/ and language/, and the native
    library in _C/."""
    files = [Path(key_module_file)]
    for sub in _HASHED_DIRS:
        for root, _dirs, names in os.walk(triton_dir / sub):
            files += [Path(root) / n for n in names if n.endswith(".py")]
    files += [p for p in (triton_dir / "_C").glob("libtriton*") if p.is_file()]
    h = hashlib.sha256(version.encode())
    for path in sorted(files):
        st = path.stat()
        h.update(f"{path.relative_to(triton_dir)}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}\n".encode())
    return h.hexdigest()


def cached_key(store: Path, stamp: str, compute: Callable[[], str]) -> str:
    """The key stored in `store` under `stamp`, or `compute()` written there (atomically) when the file
    is missing, unreadable or holds another stamp."""
    try:
        saved = json.loads(store.read_text())
        if saved.get("fingerprint") == stamp and isinstance(saved.get("key"), str):
            return saved["key"]
    except (OSError, ValueError):
        pass
    key = compute()
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
        tmp = store.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"fingerprint": stamp, "key": key}))
        os.replace(tmp, store)
    except OSError as e:  # a read-only cache directory: the key still serves this process
        logger.debug("could not store Triton's cache key in %s: %s", store, e)
    return key


def triton_cache_dir() -> Path:
    """Triton's kernel cache directory: $TRITON_CACHE_DIR, else ~/.triton/cache (Triton's default)."""
    root = os.environ.get("TRITON_CACHE_DIR")
    return Path(root) if root else Path.home() / ".triton" / "cache"


def persist_triton_key() -> str | None:
    """Make this process's `triton_key()` the stored one where Triton's files are unchanged (module
    docstring); returns the key, or None for a Triton without `triton_key` (nothing changed)."""
    mod = _defining_module()
    if mod is None:
        return None
    original = mod.triton_key
    if hasattr(original, "_tinyvllm_original"):  # stored in this process already
        return original()
    import triton

    triton_dir = Path(triton.__file__).resolve().parent
    stamp = fingerprint(triton_dir, mod.__file__, triton.__version__)
    key = cached_key(triton_cache_dir() / _FILE, stamp, original)

    def stored_key() -> str:
        return key

    stored_key._tinyvllm_original = original  # Triton's function; also marks the stored key
    for loaded in list(sys.modules.values()):  # every module that imported the function by name
        if getattr(loaded, "triton_key", None) is original and (getattr(loaded, "__name__", "") or "").startswith(
            "triton"
        ):
            loaded.triton_key = stored_key
    return key
