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
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from memtrain.config import Recipe

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


def check_kernels(recipe: "Recipe", device: "torch.device") -> None:
    """RecipeError when the recipe forces Triton kernels where they cannot run, SettingError for a switch of the
    kernels' operators or an on/off switch (:mod:`memtrain.model.switches`) set to a value it does not take (before
    anything is written: the trainer, ``memtrain eval`` and ``memtrain generate``)."""
    import torch

    from memtrain.config import RecipeError
    from memtrain.errors import SettingError
    from memtrain.kernels.op import requested_mode

    try:
        requested_mode()
        check_flags()
    except ValueError as err:
        raise SettingError(str(err)) from None
    c = recipe.memory.crossattn
    if recipe.memory.is_crossattn and c is not None and c.top_k and c.kernel == "triton":
        from memtrain.kernels.routed_attention import use_triton

        try:
            use_triton("triton", torch.empty(0, device=device))
        except RuntimeError as err:
            # the kernel's own message ends with what to use instead ("use 'auto' or 'torch' on CPU")
            raise RecipeError("memory.crossattn.kernel",
                              f"{err} (memory.crossattn.kernel: auto picks by device)") from None
    titans = []  # (key, depth, head size, hidden width or None) of Titans memories whose recipe forces the kernels
    t = recipe.model.titans
    if recipe.model.type == "titans" and t is not None and t.kernel == "triton":
        head = t.memory_head_dim or recipe.model.d_model // t.memory_heads
        titans.append(("model.titans.kernel", t.memory_depth, head, t.expansion))
    ml = recipe.memory.memory_llama
    if recipe.memory.is_memory_llama and ml is not None and ml.kernel == "triton":
        titans.append(("memory.memory_llama.kernel", ml.depth, ml.head_dim, ml.expansion))
    for key, depth, head, expansion in titans:
        from memtrain.kernels.titans import mlp_hidden, use_triton as titans_use_triton

        # MemoryLlama's default head (the base model's width over the heads) is not known before the model loads:
        # the device is checked here, the size when the memory is built
        head = head or 64
        try:
            titans_use_triton("triton", torch.empty(0, device=device), depth, head_dim=head,
                              hidden=mlp_hidden(head, expansion))
        except (RuntimeError, ValueError) as err:
            raise RecipeError(key, f"{err}; or set {key}: auto") from None


__all__ = ["FLAGS", "FUSED_ROPE", "GROUPED_WGRAD", "SWIGLU_RECOMPUTE", "TITANS_FUSED_CONV", "TITANS_FUSED_OUTPUT",
           "TITANS_FUSED_PROLOGUE", "TITANS_FUSED_READ", "check_flags", "check_kernels", "flag"]
