"""Python bytecode for the start-up bench: which imported modules were compiled from source, and a
compiled copy of the packages for images that ship none.

`pip install` compiles every module of a package to bytecode at install time, so an installed torch
imports from `__pycache__`. Some container images ship site-packages without bytecode and set
PYTHONDONTWRITEBYTECODE, so every process compiles torch's modules again inside `import torch`.
`compile_packages` writes the bytecode into a separate tree that a process reads when
PYTHONPYCACHEPREFIX names it (Python's own mechanism, `sys.pycache_prefix`): the start-up bench then
measures what an installed package costs, and records which setting it ran under.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path


def modules_from_source() -> list[str]:
    """Names of the loaded modules whose source had no usable cached bytecode in this process (a module
    loaded from `.py` with no `.pyc` where `cache_from_source` looks: `__pycache__`, or the prefix tree)."""
    names = []
    for name, module in list(sys.modules.items()):
        spec = getattr(module, "__spec__", None)
        origin = getattr(spec, "origin", None)
        if not origin or not origin.endswith(".py") or not getattr(spec, "cached", None):
            continue
        if not os.path.exists(spec.cached):
            names.append(name)
    return sorted(names)


def package_dirs(names: list[str]) -> list[Path]:
    """The source directories (or single files) of the top-level packages of module `names`."""
    out: dict[str, Path] = {}
    for top in sorted({n.split(".")[0] for n in names} - {"__main__"}):
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):  # a module that is not importable by name
            continue
        if spec is None:
            continue
        if spec.submodule_search_locations:
            for loc in spec.submodule_search_locations:
                out[loc] = Path(loc)
        elif spec.origin and spec.origin.endswith(".py"):
            out[spec.origin] = Path(spec.origin)
    return list(out.values())


def compile_packages(prefix: Path, paths: list[Path], workers: int = 0) -> int:
    """Compile every module under `paths` into the bytecode tree `prefix` (the layout that
    PYTHONPYCACHEPREFIX=`prefix` reads), skipping those already current. Returns how many paths failed
    to compile (a package's test fixtures may hold deliberately broken files; those stay uncompiled)."""
    import compileall

    saved, saved_env = sys.pycache_prefix, os.environ.get("PYTHONPYCACHEPREFIX")
    # cache_from_source, which compileall writes to, follows sys.pycache_prefix; its worker processes
    # inherit it when forked, and read the variable when spawned
    sys.pycache_prefix = os.environ["PYTHONPYCACHEPREFIX"] = str(prefix)
    failed = 0
    try:
        for path in paths:
            if path.is_dir():
                ok = compileall.compile_dir(path, quiet=2, workers=workers)
            else:
                ok = compileall.compile_file(path, quiet=2)
            failed += not ok
    finally:
        sys.pycache_prefix = saved
        if saved_env is None:
            os.environ.pop("PYTHONPYCACHEPREFIX", None)
        else:
            os.environ["PYTHONPYCACHEPREFIX"] = saved_env
    return failed
