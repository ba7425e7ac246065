"""The activations a model's blocks keep for backward, traced: one forward of the recipe's model on fake
tensors (``torch._subclasses.FakeTensorMode``: shapes and dtypes, no memory, no compute), on the device
training runs on (CUDA by default, so the same code paths run: the Titans memory's Triton kernels, whose
custom operators' fake implementations give their saved outputs), with every tensor autograd saves counted
once per storage (parameters excluded) and attributed to the block whose forward saved it. For models whose
blocks no closed formula covers (``model.type: titans``; :mod:`.memory_estimate` has the decoder's).

Attention: the trace stands in for ``F.scaled_dot_product_attention`` with what the fused GPU kernels keep --
queries, keys, values, the output, the fp32 log-sum-exp per query and the mask when there is one -- where a
fake-tensor trace would take the math path and count the full ``[B, H, Tq, Tk]`` probabilities (in fp32).
Flex attention (``model.attention: auto`` on CUDA for MAG and MAL) keeps the same minus the dense mask, which
the trace builds instead of a block mask and counts once (``B T (T + persistent)`` bytes, shared by the
layers: 64 MiB for the paper recipes' micro-batches).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F

from memtrain.config import Recipe


class _FusedAttentionSaves(torch.autograd.Function):
    """Attention's output shape, and the tensors a fused kernel saves for its backward (never run)."""

    @staticmethod
    def forward(ctx, q, k, v, mask):
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse, *([] if mask is None else [mask]))
        return out

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover - a trace has no backward
        raise RuntimeError("the activation trace's attention stand-in has no backward")


def _attention_stand_in(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return _FusedAttentionSaves.apply(q, k, v, attn_mask)


@dataclasses.dataclass
class TracedActivations:
    """Bytes saved for backward by one micro-batch's forward: per block, and before / after the blocks."""

    blocks: list[float]
    before: float
    after: float


def trace_saved_activations(recipe: Recipe, precision: str, device: str = "cuda") -> TracedActivations:
    """Trace one micro-batch (``train.micro_batch_size`` x ``data.seq_len`` tokens, one document each) of
    ``recipe``'s model in ``precision`` (``bf16``: the weights in bf16, as DeepSpeed runs them) on fake
    ``device`` tensors, without checkpointing; see the module docstring."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memtrain.model import build

    cfg = dataclasses.replace(recipe.model, attention="sdpa")
    with torch.device("meta"):
        model = build(cfg, recipe.memory, recipe.data.clustering.branching)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    B, T = recipe.train.micro_batch_size, recipe.data.seq_len
    where = ["before"]
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda m, a, i=i: where.append(i))
        block.register_forward_hook(lambda m, a, out: where.append("after"))
    counted: set = set()
    by_place: dict = {}
    sdpa, F.scaled_dot_product_attention = F.scaled_dot_product_attention, _attention_stand_in
    try:
        with FakeTensorMode():
            state = {name: torch.empty(t.shape, device=device, requires_grad=isinstance(t, torch.nn.Parameter),
                                       dtype=dtype if t.is_floating_point() else t.dtype)
                     for name, t in [*model.named_parameters(), *model.named_buffers()]}
            weights = {t.untyped_storage()._cdata for t in state.values()}

            def pack(t: torch.Tensor) -> torch.Tensor:
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in weights and key not in counted:
                    counted.add(key)
                    by_place[where[-1]] = by_place.get(where[-1], 0) + storage.nbytes()
                return t

            ids = torch.zeros(B, T, dtype=torch.long, device=device)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                torch.func.functional_call(model, state, (ids,), {"doc_ids": torch.zeros_like(ids)})
    finally:
        F.scaled_dot_product_attention = sdpa
    return TracedActivations(blocks=[float(by_place.get(i, 0)) for i in range(len(model.blocks))],
                             before=float(by_place.get("before", 0)), after=float(by_place.get("after", 0)))


def checkpointed_bytes(blocks: list[float], input_bytes: float, every: int) -> tuple[float, Optional[int]]:
    """The blocks' share at the start of backward with every ``every``-th block checkpointed (0: none): a
    checkpointed block keeps its input (``input_bytes``), and backward recomputes one at a time, which adds
    the largest of them once. Returns ``(bytes, checkpointed blocks)``."""
    if not every:
        return float(sum(blocks)), None
    ckpt = set(range(0, len(blocks), every))
    total = sum(input_bytes if i in ckpt else b for i, b in enumerate(blocks))
    return float(total + max(blocks[i] for i in ckpt)), len(ckpt)


__all__ = ["TracedActivations", "checkpointed_bytes", "trace_saved_activations"]
