"""Triton's interpreter without its redundant per-call re-patching of ``triton.language`` (tests only).

Under ``TRITON_INTERPRET=1`` every launch patches ``triton.language`` (and ``tl.core`` / ``tl.math`` /
``tl.tensor``) to the interpreter's semantics, runs the grid, and restores them. Every call of a nested
``@triton.jit`` device function (``_mm``, ``_load_mat``, ``tl.sum``, ...) patches them again
(``InterpretedFunction.__call__`` -> ``_patch_lang``): ``inspect.getmembers`` over those modules and several
hundred ``setattr``, 0.85 ms a call under cProfile, and memtrain's kernels make tens of thousands of such calls
in a test (a float16 MAC model's forward and backward: 39,724, a third of that test's profiled time). Within one
launch the second patch of the same modules sets the same behaviour again: builtins are wrapped once (a wrapper
is no builtin, so it is not wrapped twice) and the rest are the same functions anew; Triton never restores the
nested calls' patches either (the launch's own scope restores what it patched, at the launch's end).

:func:`install` makes a nested call skip the patch when every ``triton.language`` module its function sees was
patched already in the same launch (by the launch itself or by an earlier nested call); otherwise Triton's
``_patch_lang`` runs as before. The kernels compute the same, bit for bit
(``tests/test_triton_interpreter.py``); the interpreter tests take about 40% less time. ``tests/conftest.py``
installs it when the suite runs under the interpreter; where Triton's interpreter lacks the two functions it
wraps, nothing is installed.
"""

from __future__ import annotations

import inspect

_installed = None  # the uninstall function while installed


class _NoScope:
    """What a skipped patch returns in place of Triton's ``_LangPatchScope`` (nothing to restore)."""

    def restore(self) -> None:
        pass


def install():
    """Wrap the interpreter's ``_patch_lang`` and ``GridExecutor.__call__``; returns a function that puts the
    originals back, or None where the interpreter's layout differs (nothing installed). Idempotent."""
    global _installed
    if _installed is not None:
        return _installed
    try:
        import triton.language as tl
        from triton.runtime import interpreter as ti
    except ImportError:
        return None
    grid_executor = getattr(ti, "GridExecutor", None)
    original_patch = getattr(ti, "_patch_lang", None)
    if grid_executor is None or original_patch is None:
        return None
    original_call = grid_executor.__call__
    launches: list = []  # per running launch: the ids of the language modules patched in it so far
    seen: dict = {}
    stats = {"patched": 0, "skipped": 0}

    def languages(fn) -> frozenset:
        ids = seen.get(fn)
        if ids is None:
            ids = seen[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                       if inspect.ismodule(v) and v in (tl, tl.core))
        return ids

    def patch_lang(fn):
        ids = languages(fn)
        if launches and ids and ids <= launches[-1]:
            stats["skipped"] += 1
            return _NoScope()
        scope = original_patch(fn)  # Triton's own check (a function that sees no triton.language) included
        stats["patched"] += 1
        if launches:
            launches[-1] = launches[-1] | ids
        return scope

    def call(self, *args, **kwargs):
        launches.append(frozenset())
        try:
            return original_call(self, *args, **kwargs)
        finally:
            launches.pop()

    def uninstall() -> None:
        global _installed
        ti._patch_lang = original_patch
        grid_executor.__call__ = original_call
        _installed = None

    ti._patch_lang = patch_lang
    grid_executor.__call__ = call
    uninstall.stats = stats
    _installed = uninstall
    return uninstall
