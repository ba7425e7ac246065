"""SwiGLU's activation and down projection, ``w3(silu(g) * u)``, keeping only ``g`` and ``u`` for backward:
:func:`silu_mul_linear`.

Why. Eagerly, autograd keeps four ``[tokens, ffn_dim]`` tensors per SwiGLU for backward: the gate ``g = w1 x``
(SiLU's input), the up projection ``u = w2 x`` and SiLU's output ``s`` (the product's inputs), and the product
``h = s * u`` (``w3``'s input). ``s`` and ``h`` are one elementwise op each from ``g`` and ``u``, so backward can
recompute them: this keeps two of the four, half the FFN's activations. The FFN is the largest single part of
what a block keeps: in ``titans-760m-mal`` (d 1,536, ffn 4,096) 128 of the 474 MiB a block keeps per 4,096-token
sequence, 64 MiB after (``memtrain recipe show``'s traced estimate; README, "SwiGLU activations"). Recomputing costs
one SiLU and one product per FFN in backward, elementwise work beside the FFN's three GEMMs (Megatron-LM's
selective recomputation and Liger-Kernel's SwiGLU make the same trade).

Exactness. The forward is ``F.linear(F.silu(g) * u, weight)``, the ops the module ran; backward calls the ops
autograd's own formulas call for ``silu``, ``mul`` and the matmul behind ``F.linear`` (``grad @ W`` for the
input, ``grad^T @ h`` for the weight), so the gradients equal autograd's bit for bit on the same device
(tests/test_swiglu.py checks float32 and bf16 on CPU, and float64 against autograd).

Where it applies (:func:`silu_mul_linear`, otherwise plain ``F.linear(F.silu(g) * u, weight)``): eager (a compiled
graph's partitioner chooses what to keep itself), gradients on, autocast off (backward multiplies in the
tensors' own dtypes), a weight DeepSpeed's ZeRO-3 does not partition (its hooks gather ``w3``'s weight around
``w3``'s own forward, which this bypasses; a partitioned parameter carries ``ds_id``) and
``MEMTRAIN_SWIGLU_RECOMPUTE`` not ``0``. Not twice differentiable (``once_differentiable``). The anchor's FFN with
a LoRA-FFN memory keeps the plain ops: its ``w3`` delta reads the product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from memtrain.model import switches

RECOMPUTE_ENV = switches.SWIGLU_RECOMPUTE


class _SiluMulLinear(torch.autograd.Function):
    """``F.linear(F.silu(g) * u, weight)`` saving ``g``, ``u`` and ``weight``; backward recomputes ``silu(g) * u``."""

    @staticmethod
    def forward(ctx, g: torch.Tensor, u: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(g, u, weight)
        return F.linear(F.silu(g) * u, weight)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        g, u, weight = ctx.saved_tensors
        s = F.silu(g)
        h = s * u
        grad_2d = grad.reshape(-1, grad.shape[-1])
        # the matmul F.linear runs on a [..., f] input: h viewed [N, f] times weight^T (mm's backward: the
        # input's gradient grad @ W, the transposed weight's (h^T grad), laid out as W is: grad^T @ h)
        grad_w = grad_2d.t().mm(h.reshape(-1, h.shape[-1])) if ctx.needs_input_grad[2] else None
        grad_g = grad_u = None
        if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
            grad_h = grad_2d.mm(weight).reshape(h.shape)
            grad_u = grad_h * s if ctx.needs_input_grad[1] else None
            grad_g = torch.ops.aten.silu_backward(grad_h * u, g) if ctx.needs_input_grad[0] else None
        return grad_g, grad_u, grad_w


def recompute_applies(g: torch.Tensor, u: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`silu_mul_linear` recomputes (module docstring, "Where it applies")."""
    return (torch.is_grad_enabled() and (g.requires_grad or u.requires_grad or weight.requires_grad)
            and not torch.compiler.is_compiling() and not torch.is_autocast_enabled(g.device.type)
            and not hasattr(weight, "ds_id") and switches.flag(RECOMPUTE_ENV))


def silu_mul_linear(g: torch.Tensor, u: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(F.silu(g) * u, weight)``, keeping only ``g`` and ``u`` for backward where that applies."""
    if recompute_applies(g, u, weight):
        return _SiluMulLinear.apply(g, u, weight)
    return F.linear(F.silu(g) * u, weight)


__all__ = ["RECOMPUTE_ENV", "recompute_applies", "silu_mul_linear"]
