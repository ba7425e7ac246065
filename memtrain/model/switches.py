"""The on/off switches memtrain reads from the environment: each turns one fused kernel or one saving off.

Every one is on by default (unset, empty or ``1``) and ``0`` turns it off: a way back should that piece misbehave on
some GPU (``tools/gpu_check.py`` sets ``0`` when a piece's guard tests fail there), and a way to measure what it
gains. Any other value is refused, because reading ``off`` or ``false`` as "not 0", that is on, would silently run
what the user asked to turn off. :func:`check_flags` refuses it before a model is built (``memtrain.model.build``, and
the trainer's checks before a run directory is touched: one line naming the variable, exit 2); :func:`flag` reads a
switch where it applies, per call, so a test or a benchmark may flip it between calls.

The switches that choose among several forms (``MEMTRAIN_TITANS_BACKWARD``, ``_FORWARD``, ``_WAVE``, ``_STAGES``,
``MEMTRAIN_KERNEL_OPS``) live beside the kernels they pick (``memtrain.kernels.titans``, ``memtrain.kernels.op``) and
are checked the same way.
"""

from __future__ import annotations

import os

FUSED_ROPE = "MEMTRAIN_FUSED_ROPE"
TITANS_FUSED_PROLOGUE = "MEMTRAIN_TITANS_FUSED_PROLOGUE"
TITANS_FUSED_CONV = "MEMTRAIN_TITANS_FUSED_CONV"
TITANS_FUSED_OUTPUT = "MEMTRAIN_TITANS_FUSED_OUTPUT"
TITANS_FUSED_READ = "MEMTRAIN_TITANS_FUSED_READ"
GROUPED_WGRAD = "MEMTRAIN_GROUPED_WGRAD"
SWIGLU_RECOMPUTE = "MEMTRAIN_SWIGLU_RECOMPUTE"

# what 0 turns off (README, "Titans kernels": the switches)
FLAGS: dict[str, str] = {
    FUSED_ROPE: "the fused RoPE kernel (memtrain.kernels.rope)",
    TITANS_FUSED_PROLOGUE: "the Titans memory's fused q/k/v and gate kernels, the fused convolution with them",
    TITANS_FUSED_CONV: "the causal convolution fused into the Titans q/k/v kernels",
    TITANS_FUSED_OUTPUT: "the Titans memory's fused output stage",
    TITANS_FUSED_READ: "MAC's fused retrieval",
    GROUPED_WGRAD: "the grouped per-segment weight gradients (memtrain.model.grouped_linear)",
    SWIGLU_RECOMPUTE: "the SwiGLU's recomputation in backward (memtrain.model.swiglu)",
}


def _refusal(name: str, raw: str) -> str:
    return f"{name}={raw!r}: expected 0 (turns off {FLAGS[name]}) or 1 (on, the default; or unset it)"


def flag(name: str) -> bool:
    """Whether the switch ``name`` (one of :data:`FLAGS`) is on: unset, empty or ``1``; off for ``0``; ValueError
    (one line) for any other value."""
    raw = os.environ.get(name, "")
    if raw == "0":
        return False
    if raw == "" or raw == "1":
        return True
    raise ValueError(_refusal(name, raw))


def check_flags() -> None:
    """ValueError (one line, the first bad one) where a switch of :data:`FLAGS` holds a value :func:`flag` refuses."""
    for name in FLAGS:
        flag(name)


__all__ = ["FLAGS", "FUSED_ROPE", "GROUPED_WGRAD", "SWIGLU_RECOMPUTE", "TITANS_FUSED_CONV", "TITANS_FUSED_OUTPUT",
           "TITANS_FUSED_PROLOGUE", "TITANS_FUSED_READ", "check_flags", "flag"]
