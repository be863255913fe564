"""Test-wide set-up: without a GPU, Triton kernels run in the interpreter; `gpu` tests are skipped."""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if os.environ.get("PYTEST_XDIST_WORKER"):
    # Several workers share few cores: OpenMP threads spinning against each other cost more than they give.
    torch.set_num_threads(1)
if not HAS_CUDA:
    # Must be set before any @triton.jit function is defined, i.e. before kernel modules are imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_the_language_once_per_launch() -> None:
    """Make Triton's interpreter patch triton.language once per kernel launch, not once per helper call.

    The interpreter swaps the language's builtins for NumPy versions when a kernel launches (`_patch_lang`,
    undone when the launch ends) and again on every call of a @triton.jit helper inside it: a scan of every
    member of the language modules each time, about half the run time of helper-heavy kernels (the
    truncating sampler's). A helper's own patch is never undone and finds the same modules already patched
    (builtins already swapped; the other attributes set to equivalent functions), so it is skipped when
    every language module its globals name was patched earlier in the same launch: the kernels run the
    same operations. Left alone where the interpreter's internals are not the ones this expects."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang", None)
    empty_scope = getattr(interpreter, "_LangPatchScope", None)
    if original is None or empty_scope is None or getattr(original, "once_per_launch", False):
        return
    patched: set[int] = set()  # ids of the language modules patched in the open launch (empty: none open)

    class LaunchScope:
        """The launch's own patch: undone at its end, which also closes the launch."""

        def __init__(self, scope):
            self.scope = scope

        def restore(self) -> None:
            patched.clear()
            self.scope.restore()

    def patch_lang(fn):
        langs = {id(v) for v in fn.__globals__.values() if isinstance(v, type(tl)) and v in (tl, tl.core)}
        if patched and langs and langs <= patched:
            return empty_scope()  # a helper inside the launch: nothing left to patch
        opens = not patched
        scope = original(fn)
        patched.update(langs)
        return LaunchScope(scope) if opens else scope

    patch_lang.once_per_launch = True
    interpreter._patch_lang = patch_lang


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_the_language_once_per_launch()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the GPU through the device tool)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
