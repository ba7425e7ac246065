"""Hierarchical parametric memories: the block layout and its initialisation.

Hierarchical-memories paper (Pouransari et al.), Sections 2.1-2.2 and Appendix I. Every cluster of
level l owns one block of s_l = c0 * r_l parameters; a sequence fetches one block per level. A block
is stored as one flat row. Its layout is the same for every level: for each memory layer i (in
order), ``r_{l,i}`` *units* of ``unit`` parameters, where one unit is one rank of every adapted
matrix of that layer (Appendix I):

- ``ffn``: one extra SwiGLU inner channel, ``[w1 row (d) | w2 row (d) | w3 column (d)]``,
  c0 = 3 L d (I.1: 53,760 for the 160M anchor);
- ``lora`` on ``qk``: ``[A_q (d) | B_q (h d_h) | A_k (d) | B_k (kv d_h)]``, c0 = 2 L (d + h d_h);
  on ``vo``: ``[A_v (d) | B_v (kv d_h) | A_o (h d_h) | B_o (d)]``, c0 = 2 L (d + h d_h);
  on ``ffn``: ``[A_1 (d) | B_1 (d_f) | A_2 (d) | B_2 (d_f) | A_3 (d_f) | B_3 (d)]``, c0 = 3 L (d + d_f);
- ``kv``: one learned key and value per layer, ``[k (kv d_h) | v (kv d_h)]``, c0 = 2 L kv d_h.

``placement`` (Appendix F): ``uniform`` puts r_l units on each of the L layers; ``early``, ``middle``
and ``late`` put the same r_l * L units on the first, middle or last ``placement_layers`` layers
(spread evenly, the first layers taking the remainder), so sizes never depend on placement.

At a layer, the units of all levels are concatenated (rank R_i = sum_l r_{l,i}) and applied with
batched matrix products, one memory per sequence ([B, R_i, unit] against [B, T, d]); no loop over
sequences. Initialisation gives memories no effect (Appendix I): ``w3`` parts, LoRA ``B`` parts and KV
values are zero; ``w1``/``w2`` and KV keys are truncated normals like the anchor's matrices; LoRA
``A`` parts are Kaiming-uniform (bound 1/sqrt(fan_in), as ``nn.Linear`` and peft).

The bank (:mod:`memtrain.parallel.bank`) stores the rows; the model holds the generic memory (one
block per level, Section 4) and consumes :class:`~memtrain.model.hierarchical.memory.FetchedMemory`
(:mod:`.memory`, which also holds the batched ops). Imports torch only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch import nn

from memtrain.config import MemoryConfig


@dataclass(frozen=True)
class AnchorDims:
    """The anchor widths a memory layout depends on."""

    d_model: int
    n_layers: int
    q_width: int  # h * d_h
    kv_width: int  # kv_heads * d_h
    ffn_dim: int
    head_dim: int
    init_std: float  # sigma of the anchor's truncated-normal matrices


@dataclass(frozen=True)
class Part:
    name: str
    width: int
    init: str  # "normal" (truncated normal, anchor sigma), "zeros", "kaiming" (uniform, 1/sqrt(fan_in))
    fan_in: int = 0


def unit_parts(kind: str, lora_target: str, dims: AnchorDims) -> tuple[Part, ...]:
    """The parts of one unit (one rank of every adapted matrix of one layer), in storage order."""
    d, q, kv, f = dims.d_model, dims.q_width, dims.kv_width, dims.ffn_dim
    if kind == "ffn":
        return (Part("w1", d, "normal"), Part("w2", d, "normal"), Part("w3", d, "zeros"))
    if kind == "kv":
        return (Part("k", kv, "normal"), Part("v", kv, "zeros"))
    if kind == "lora":
        pairs = {"qk": (("q", d, q), ("k", d, kv)),
                 "vo": (("v", d, kv), ("o", q, d)),
                 "ffn": (("w1", d, f), ("w2", d, f), ("w3", f, d))}[lora_target]
        parts: list[Part] = []
        for name, fan_in, fan_out in pairs:
            parts += [Part(f"{name}_a", fan_in, "kaiming", fan_in), Part(f"{name}_b", fan_out, "zeros")]
        return tuple(parts)
    raise ValueError(f"unknown memory type {kind!r}")


def placement_layers(placement: str, n_layers: int, count: int) -> list[int]:
    """The anchor layers that carry memory (Appendix F)."""
    if placement == "uniform":
        return list(range(n_layers))
    n = min(count, n_layers)
    start = {"early": 0, "middle": (n_layers - n) // 2, "late": n_layers - n}[placement]
    return list(range(start, start + n))


def spread(total: int, n: int) -> list[int]:
    """``total`` units over ``n`` layers as evenly as possible, the first layers taking the remainder."""
    base, extra = divmod(total, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


@dataclass
class MemoryLayout:
    """Sizes and row layout of a hierarchical memory for one anchor (see the module docstring)."""

    kind: str
    lora_target: str
    lora_alpha: float
    dims: AnchorDims
    levels: tuple[int, ...]  # r_1..r_p
    branching: int
    layers: tuple[int, ...]  # anchor layers with memory
    units: tuple[tuple[int, ...], ...]  # units[l][j]: units of level l at layers[j]
    parts: tuple[Part, ...] = field(default=())

    @classmethod
    def build(cls, cfg: MemoryConfig, dims: AnchorDims, branching: int) -> "MemoryLayout":
        if not cfg.levels or any(r < 0 for r in cfg.levels) or not any(cfg.levels):
            raise ValueError(f"memory.levels must give one multiplier r_l >= 0 per clustering level, not all 0; "
                             f"got {cfg.levels}")
        layers = placement_layers(cfg.placement, dims.n_layers, cfg.placement_layers)
        units = tuple(tuple(spread(r * dims.n_layers, len(layers))) for r in cfg.levels)
        return cls(cfg.type, cfg.lora_target, cfg.lora_alpha, dims, tuple(cfg.levels), branching, tuple(layers),
                   units, unit_parts(cfg.type, cfg.lora_target, dims))

    @property
    def unit(self) -> int:
        return sum(p.width for p in self.parts)

    @property
    def c0(self) -> int:
        """Parameters per unit of multiplier: s_l = c0 * r_l (Appendix I)."""
        return self.unit * self.dims.n_layers

    @property
    def depth(self) -> int:
        return len(self.levels)

    def block_size(self, level: int) -> int:
        """s_l for 0-based ``level``."""
        return self.c0 * self.levels[level]

    def rows(self, level: int) -> int:
        """k^l clusters at 0-based ``level``."""
        return self.branching ** (level + 1)

    @property
    def active_levels(self) -> list[int]:
        return [l for l, r in enumerate(self.levels) if r > 0]

    @property
    def fetched_parameters(self) -> int:
        """|R(x; W)| = sum_l s_l (Section 2.1)."""
        return sum(self.block_size(l) for l in range(self.depth))

    @property
    def bank_parameters(self) -> int:
        """|W| = sum_l s_l k^l (Section 2.1)."""
        return sum(self.block_size(l) * self.rows(l) for l in range(self.depth))

    def layer_rank(self, layer: int) -> int:
        """R_i: memory units at anchor ``layer`` over all levels (0 if the layer has no memory)."""
        if layer not in self.layers:
            return 0
        j = self.layers.index(layer)
        return sum(u[j] for u in self.units)

    # -- rows <-> per-layer memories ---------------------------------------------------------------

    def init_rows(self, rows: torch.Tensor, level: int, generator: Optional[torch.Generator] = None, *,
                  row_ids: Optional[torch.Tensor] = None, n_rows: Optional[int] = None,
                  chunk_rows: Optional[int] = None) -> None:
        """Initialise ``rows [n, s_l]`` of ``level`` in place so that the memories have no effect.

        Draws come from ``generator`` (the global RNG when None) on the generator's device, then are
        copied to ``rows``' device: for each memory layer and each random part (in storage order), one
        ``[n, units, width]`` draw. ``row_ids`` (sorted global ids, one per row of ``rows``) with
        ``n_rows`` (the level's row count): ``rows`` receives exactly those rows of the ``[n_rows, s_l]``
        table the same generator would give -- every part is still drawn for all ``n_rows`` rows, in
        the same order, but ``chunk_rows`` rows at a time (default: all), keeping only the wanted ones.
        That is bitwise the full draw because a generator's draws are sequential: one ``[a + b, ...]``
        draw equals an ``[a, ...]`` draw followed by a ``[b, ...]`` draw (CPU generators; checked by
        tests/test_sharded_bank.py). Time O(n_rows s_l), memory O(chunk + rows)."""
        if rows.is_meta or rows.numel() == 0:
            return
        if row_ids is None:
            if n_rows is not None and n_rows != rows.shape[0]:
                raise ValueError(f"n_rows={n_rows} without row_ids must equal the rows given ({rows.shape[0]})")
            n_rows = rows.shape[0]
        elif n_rows is None or row_ids.shape != (rows.shape[0],):
            raise ValueError("row_ids needs n_rows and one id per row of rows")
        draw_device = generator.device if generator is not None else rows.device
        ids = row_ids.to("cpu") if row_ids is not None else None
        step = max(1, chunk_rows or n_rows)
        with torch.no_grad():
            views = self.split_level(rows, level)
            for view in views:  # [n, units, unit]
                if view.shape[1] == 0:
                    continue
                offset = 0
                for part in self.parts:
                    block = view[..., offset:offset + part.width]
                    offset += part.width
                    if part.init == "zeros":
                        block.zero_()
                        continue
                    for start in range(0, n_rows, step):
                        stop = min(start + step, n_rows)
                        drawn = self._draw(part, (stop - start, *block.shape[1:]), draw_device, generator)
                        if ids is None:
                            block[start:stop].copy_(drawn)
                            continue
                        lo, hi = (int(i) for i in torch.searchsorted(ids, torch.tensor([start, stop])))
                        if hi > lo:
                            block[lo:hi].copy_(drawn.index_select(0, ids[lo:hi] - start))

    def _draw(self, part: Part, shape: tuple[int, ...], device: torch.device,
              generator: Optional[torch.Generator]) -> torch.Tensor:
        """One fp32 draw of a random part: truncated normal (anchor sigma) or Kaiming uniform."""
        if part.init == "normal":
            return _trunc_normal(shape, self.dims.init_std, torch.float32, device, generator)
        bound = 1.0 / math.sqrt(part.fan_in)
        u = torch.rand(shape, generator=generator, device=device, dtype=torch.float32)
        return (u * 2 - 1) * bound

    def split_level(self, rows: torch.Tensor, level: int) -> list[torch.Tensor]:
        """``rows [n, s_l]`` -> one view ``[n, units, unit]`` per memory layer (no copies)."""
        sizes = [u * self.unit for u in self.units[level]]
        return [chunk.view(rows.shape[0], u, self.unit)
                for chunk, u in zip(rows.split(sizes, dim=1), self.units[level])]

    def per_layer(self, level_rows: Sequence[Optional[torch.Tensor]]) -> list[Optional[torch.Tensor]]:
        """Per-level rows ``[B, s_l]`` (None for levels with r_l = 0) -> one tensor ``[B, R_i, unit]``
        per anchor layer (levels concatenated along the rank), None for layers without memory."""
        out: list[Optional[torch.Tensor]] = [None] * self.dims.n_layers
        split = [self.split_level(rows, l) if rows is not None else None for l, rows in enumerate(level_rows)]
        for j, layer in enumerate(self.layers):
            pieces = [s[j] for s in split if s is not None and s[j].shape[1] > 0]
            if pieces:
                out[layer] = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)
        return out

    def parts_of(self, mem: torch.Tensor) -> dict[str, torch.Tensor]:
        """``[B, R, unit]`` -> ``{part name: [B, R, width]}`` views."""
        out, offset = {}, 0
        for part in self.parts:
            out[part.name] = mem[..., offset:offset + part.width]
            offset += part.width
        return out


def _trunc_normal(shape, std: float, dtype, device, generator) -> torch.Tensor:
    t = torch.empty(shape, dtype=torch.float32, device=device)
    if generator is None:
        nn.init.trunc_normal_(t, 0.0, std, -3 * std, 3 * std)
    else:  # inverse-CDF sampling from a given generator (nn.init takes none in every torch version)
        u = torch.rand(shape, generator=generator, device=device, dtype=torch.float32)
        lo, hi = 0.5 * (1 + math.erf(-3 / math.sqrt(2))), 0.5 * (1 + math.erf(3 / math.sqrt(2)))
        t = torch.erfinv(2 * (lo + u * (hi - lo)) - 1) * (std * math.sqrt(2))
    return t.to(dtype)


__all__ = ["AnchorDims", "MemoryLayout", "Part", "placement_layers", "spread", "unit_parts"]
