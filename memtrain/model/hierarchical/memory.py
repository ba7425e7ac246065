"""What a model with hierarchical memories receives and applies: the per-sequence fetched rows
(:class:`FetchedMemory`), the generic memory (Section 4 of the hierarchical-memories paper) and the
memory ops, batched over sequences (Section 2.2, Appendix I). The block layout they read is
:mod:`memtrain.model.hierarchical.layout`. Imports torch only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from memtrain.model.hierarchical.layout import MemoryLayout

# --------------------------------------------------------------------------------------------------
# What the model receives


@dataclass
class FetchedMemory:
    """Per-sequence memory for one micro-batch.

    ``levels[l]``: ``[B, s_l]`` fetched rows (differentiable w.r.t. the bank; None for r_l = 0 or when
    every sequence is generic). ``generic``: ``[B]`` bool, sequences that use the generic memory instead
    (their rows in ``levels`` are ignored). ``ids``: the ``[B, p]`` cluster ids fetched, for monitoring.
    """

    levels: list[Optional[torch.Tensor]]
    generic: Optional[torch.Tensor] = None
    ids: Optional[torch.Tensor] = None

    @classmethod
    def all_generic(cls, batch_size: int, depth: int, device: torch.device | str = "cpu") -> "FetchedMemory":
        return cls([None] * depth, torch.ones(batch_size, dtype=torch.bool, device=device))


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors (two's-complement wrap-around, logical shifts emulated):
    a bijective 64-bit mix whose outputs pass as independent uniform bits for distinct inputs."""
    def shr(v: torch.Tensor, n: int) -> torch.Tensor:
        return (v >> n) & ((1 << (64 - n)) - 1)

    def wrap(c: int) -> int:
        return c - (1 << 64) if c >= 1 << 63 else c

    x = x + wrap(0x9E3779B97F4A7C15)
    x = (x ^ shr(x, 30)) * wrap(0xBF58476D1CE4E5B9)
    x = (x ^ shr(x, 27)) * wrap(0x94D049BB133111EB)
    return x ^ shr(x, 31)


def generic_mask(sample_index: torch.Tensor, step: int, seed: int, prob: float) -> torch.Tensor:
    """``[B]`` bool: which training sequences use the generic memory, each independently with ``prob``
    (Section 4: 1/(k+1), so that the generic block sees as many sequences as one level-1 block).

    The draw of a sequence is a hash of (``seed``, ``step``, its global ``sample_index``), not a
    per-rank random stream: the same step draws the same way on any number of ranks, and a resumed run
    (on any world size) draws as the uninterrupted one did, with no generator state to checkpoint."""
    key = _splitmix64(torch.tensor([seed], dtype=torch.int64))
    key = _splitmix64(key ^ step)
    bits = _splitmix64(key ^ sample_index.to(torch.int64).cpu())
    uniform = ((bits >> 11) & ((1 << 53) - 1)).double() * 2.0**-53  # the top 53 bits: a double in [0, 1)
    return (uniform < prob).to(sample_index.device)


class GenericMemory(nn.Module):
    """One block per level used in place of fetched blocks (Section 4): same size as a fetched memory,
    trained on the sequences that draw it, the baseline of the fetched-vs-generic comparison."""

    def __init__(self, layout: MemoryLayout):
        super().__init__()
        self.layout = layout
        self.blocks = nn.ParameterList(
            [nn.Parameter(torch.empty(1, layout.block_size(l))) for l in range(layout.depth)])
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for l, p in enumerate(self.blocks):
            self.layout.init_rows(p.data, l)

    def forward(self, memory: FetchedMemory, batch_size: int) -> list[Optional[torch.Tensor]]:
        """:meth:`mix`, called as the module (``generic_memory(memory, B)``) so that ZeRO-3 gathers the
        generic blocks around it, as it does for any submodule's parameters."""
        return self.mix(memory, batch_size)

    def mix(self, memory: FetchedMemory, batch_size: int) -> list[Optional[torch.Tensor]]:
        """Per-level rows ``[B, s_l]`` with generic sequences replaced by the generic block."""
        out: list[Optional[torch.Tensor]] = []
        for l, generic in enumerate(self.blocks):
            if self.layout.levels[l] == 0:
                out.append(None)
                continue
            fetched = memory.levels[l] if l < len(memory.levels) else None
            g = generic.expand(batch_size, -1)
            if memory.generic is None:
                if fetched is None:
                    raise ValueError(f"no fetched rows for memory level {l + 1} and no generic mask")
                out.append(fetched)
            elif fetched is None:
                if not bool(memory.generic.all()):
                    raise ValueError(f"no fetched rows for memory level {l + 1} but some sequences are not generic")
                out.append(g)
            else:
                out.append(torch.where(memory.generic[:, None], g.to(fetched.dtype), fetched))
        return out


# --------------------------------------------------------------------------------------------------
# The memory ops (batched over sequences)


def ffn_memory(x: torch.Tensor, mem: torch.Tensor, layout: MemoryLayout, act=F.silu) -> torch.Tensor:
    """Extra SwiGLU channels: ``act(x W1_m^T) * (x W2_m^T) @ W3_m``, ``x [B, T, d]``, ``mem [B, R, 3d]``
    (``act`` is the anchor FFN's gate activation)."""
    p = layout.parts_of(mem.to(x.dtype))
    h = act(torch.bmm(x, p["w1"].transpose(1, 2))) * torch.bmm(x, p["w2"].transpose(1, 2))
    return torch.bmm(h, p["w3"])


def lora_delta(x: torch.Tensor, mem: torch.Tensor, layout: MemoryLayout, name: str) -> torch.Tensor:
    """LoRA memory ``scale * (x A^T) B^T`` for matrix ``name`` (scale alpha / R, as in LoRA and peft)."""
    p = layout.parts_of(mem.to(x.dtype))
    scale = layout.lora_alpha / mem.shape[1]
    return torch.bmm(torch.bmm(x, p[f"{name}_a"].transpose(1, 2)), p[f"{name}_b"]) * scale


def kv_memory(q: torch.Tensor, mem: torch.Tensor, layout: MemoryLayout) -> torch.Tensor:
    """Queries ``[B, H, T, d_h]`` attend to the sequence's R learned keys/values (no causal mask, no
    positional encoding; Appendix I); returns ``[B, H, T, d_h]`` to add to the attention output."""
    B, H, T, dh = q.shape
    p = layout.parts_of(mem.to(q.dtype))
    R = mem.shape[1]
    kv_heads = layout.dims.kv_width // dh
    k = p["k"].reshape(B, R, kv_heads, dh).transpose(1, 2)
    v = p["v"].reshape(B, R, kv_heads, dh).transpose(1, 2)
    if kv_heads != H:
        k = k.repeat_interleave(H // kv_heads, dim=1)
        v = v.repeat_interleave(H // kv_heads, dim=1)
    return F.scaled_dot_product_attention(q, k, v)


__all__ = ["FetchedMemory", "GenericMemory", "ffn_memory", "generic_mask", "kv_memory", "lora_delta"]
