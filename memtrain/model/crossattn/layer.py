"""Memory cross-attention layers and the set of them a model carries (crossattn-memory-banks paper,
Sections 3.1-3.4 and 5.3).

:class:`MemoryCrossAttention` is one layer: ``Q = H W_Q`` (eq. 1), ``K = M W_K``, ``V = M W_V`` (eq.
2-3) over the bank ``M`` (or its routed chapters, :mod:`.routing`), softmax attention (eq. 4), and an
output projection ``W_O`` back to ``d_model`` (eq. 21; zero-initialised, so a memory layer changes
nothing at initialisation). With a reduced dimension ``r`` (eq. 15-20) the bank's tokens are ``r``
wide, ``W_Q`` maps ``d -> r``, ``W_K``/``W_V`` act in ``r`` and ``W_O`` maps ``r -> d``. With
``proj_rank`` the projections are factorised ``W_down W_up`` (eq. 14).

:class:`CrossAttnMemory` owns the banks (one shared, or one per memory layer; Section 3.4), the layers
at the placement of Section 3.3, variant B's extra norm + MLP (zero-initialised output), and the
per-step statistics (chapter usage, router loss) the trainer logs.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable, Optional

import torch
from torch import nn

from memtrain.config import CrossAttnConfig, ModelConfig
from memtrain.model.crossattn.bank import LatentBank
from memtrain.model.crossattn.routing import (ChapterRouter, DocumentSegments, Routing, full_bank_attention,
                                              routed_attention, sequence_routed_attention)
from memtrain.model.swiglu import silu_mul_linear


def memory_layer_indices(c: CrossAttnConfig, n_layers: int) -> list[int]:
    """Section 3.3's placement: all layers, the first / last ``placement_k``, or every
    ``placement_k``-th from layer 0; ``layers`` overrides."""
    if c.layers is not None:
        return sorted(c.layers)
    if c.placement == "all":
        return list(range(n_layers))
    if c.placement == "first":
        return list(range(min(c.placement_k, n_layers)))
    if c.placement == "last":
        return list(range(max(0, n_layers - c.placement_k), n_layers))
    return list(range(0, n_layers, c.placement_k))


def _projection(d_in: int, d_out: int, rank: Optional[int]) -> nn.Module:
    if rank:
        return nn.Sequential(nn.Linear(d_in, rank, bias=False), nn.Linear(rank, d_out, bias=False))
    return nn.Linear(d_in, d_out, bias=False)


def _init_projection(module: nn.Module, std: float) -> None:
    if isinstance(module, nn.Sequential):  # W_down W_up: the product keeps the full matrix's std
        rank = module[0].out_features
        nn.init.normal_(module[0].weight, std=math.sqrt(std) / rank ** 0.25)
        nn.init.normal_(module[1].weight, std=math.sqrt(std) / rank ** 0.25)
    else:
        nn.init.normal_(module.weight, std=std)


class MemoryCrossAttention(nn.Module):
    """One memory cross-attention layer over a :class:`LatentBank` (module docstring)."""

    def __init__(self, d_model: int, bank_width: int, width: int, heads: int, chapters: int = 1, top_k: int = 0,
                 routing: str = "sequence", proj_rank: Optional[int] = None, kernel: str = "auto"):
        super().__init__()
        self.kernel = kernel  # routed attention: Triton kernels (auto on CUDA, triton) or the PyTorch reference
        if width % heads:
            raise ValueError(f"memory attention width {width} does not split into {heads} heads")
        self.heads, self.head_dim, self.width = heads, width // heads, width
        self.wq = _projection(d_model, width, proj_rank)
        self.wk = _projection(bank_width, width, proj_rank)
        self.wv = _projection(bank_width, width, proj_rank)
        self.wo = nn.Linear(width, d_model, bias=False)
        self.router = ChapterRouter(d_model, chapters, top_k, routing) if top_k else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.wo.weight.is_meta:
            return
        _init_projection(self.wq, 1.0 / math.sqrt(self.wq_in))
        _init_projection(self.wk, 1.0 / math.sqrt(self.wk_in))
        _init_projection(self.wv, 1.0 / math.sqrt(self.wk_in))
        nn.init.zeros_(self.wo.weight)  # no effect at initialisation (Section 5: adapters leave the model as it was)
        if self.router is not None:
            self.router.reset_parameters()

    @property
    def wq_in(self) -> int:
        return (self.wq[0] if isinstance(self.wq, nn.Sequential) else self.wq).in_features

    @property
    def wk_in(self) -> int:
        return (self.wk[0] if isinstance(self.wk, nn.Sequential) else self.wk).in_features

    def key_values(self, bank: LatentBank, ids: Optional[torch.Tensor], dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of chapters ``ids`` (``[U]``) as ``[U, N_c, H, D]`` each, or of the whole bank
        (``ids`` None) as ``[N_m, H, D]``."""
        m = bank.all(dtype) if ids is None else bank.chapters(ids, dtype)
        shape = (*m.shape[:-1], self.heads, self.head_dim)
        return self.wk(m).view(shape), self.wv(m).view(shape)

    def forward(self, h: torch.Tensor, bank: LatentBank, record: Optional[Callable[[Routing], None]] = None,
                documents: Optional[DocumentSegments] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``h`` ``[B, T, d]`` (normalised); returns ``(output [B, T, d], load-balancing loss or None)``.
        ``record`` receives the routing decision of a training forward (:meth:`RoutingStats.recorder`);
        ``documents``: the rows' documents when they are packed (sequence routing routes each one)."""
        B, T, _ = h.shape
        q = self.wq(h).view(B, T, self.heads, self.head_dim)
        if self.router is None:
            keys, values = self.key_values(bank, None, q.dtype)
            out, loss = full_bank_attention(q, keys, values), None
        else:
            routing = self.router(h, documents)
            kv = lambda ids: self.key_values(bank, ids, q.dtype)  # noqa: E731
            if routing.per_row:  # one chapter set per row: the kernel reads it once for all the row's tokens
                out = sequence_routed_attention(q, kv, routing.decisions, routing.log_weights[:, 0], self.kernel)
            else:  # per token, or per document of packed rows
                out = routed_attention(q, kv, routing.chapters, routing.log_weights, self.kernel)
            loss = routing.loss
            if record is not None and self.training:  # training forwards only (not validation)
                record(routing)
        return self.wo(out.reshape(B, T, self.width)), loss


class RoutingStats:
    """Chapter usage and router loss summed over the training forwards of one optimizer step (all memory
    layers, micro-batches), per bank; the trainer reads and resets them (``memory_module/*`` in
    TensorBoard). A decision counts once however many of a micro-batch's tokens share it (a sequence,
    or a document of packed rows, under sequence routing), and once per forward: the recomputation of a
    checkpointed block in backward records nothing (:meth:`CrossAttnMemory.read`'s ``record``)."""

    def __init__(self, chapters: int, banks: int = 1) -> None:
        self.chapters, self.banks = chapters, banks
        self.reset()

    def reset(self) -> None:
        self.counts = torch.zeros(self.banks, self.chapters, dtype=torch.float64)
        self.loss, self.calls = 0.0, 0

    def recorder(self, bank: int) -> Callable[[Routing], None]:
        """What a memory layer reading bank ``bank`` calls with its routing decision."""
        return partial(self.add, bank=bank)

    def add(self, routing: Routing, bank: int = 0) -> None:
        ids = routing.decisions.detach()
        self.counts[bank] += torch.bincount(ids.reshape(-1).cpu(), minlength=self.chapters).double()
        self.loss += float(routing.loss.detach())
        self.calls += 1

    def summary(self) -> dict[str, float]:
        """Over the banks read this step: the mean of each bank's chapter-usage entropy (nats; at most
        ``log C``), the chapters of those banks no decision chose, and the mean router loss."""
        used = self.counts[self.counts.sum(1) > 0]
        if not len(used):
            return {}
        p = used / used.sum(1, keepdim=True)
        entropy = -torch.where(p > 0, p * p.log(), torch.zeros_like(p)).sum(1)
        return {"memory_module/chapter_entropy": float(entropy.mean()),
                "memory_module/chapter_entropy_max": math.log(self.chapters),
                "memory_module/dead_chapters": float((used == 0).sum()),
                "memory_module/router_loss": self.loss / max(self.calls, 1)}


class _SwiGLU(nn.Module):
    """Variant B's extra MLP (Section 3.2), SwiGLU as the anchor's; ``w3`` zero-initialised."""

    def __init__(self, d_model: int, ffn_dim: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, ffn_dim, bias=False)
        self.w2 = nn.Linear(d_model, ffn_dim, bias=False)
        self.w3 = nn.Linear(ffn_dim, d_model, bias=False)
        if not self.w1.weight.is_meta:
            nn.init.normal_(self.w1.weight, std=1.0 / math.sqrt(d_model))
            nn.init.normal_(self.w2.weight, std=1.0 / math.sqrt(d_model))
            nn.init.zeros_(self.w3.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_mul_linear(self.w1(x), self.w2(x), self.w3.weight)


class MemoryBlockPart(nn.Module):
    """What a memory layer adds to a transformer block: pre-norm, the cross-attention, and for variant B
    another pre-norm + MLP. ``forward(x, bank)`` returns the new residual stream (``x`` plus the memory
    read, then plus the MLP in variant B) and the routing loss."""

    def __init__(self, d_model: int, norm: nn.Module, attn: MemoryCrossAttention, variant: str,
                 ffn_dim: int, norm_factory):
        super().__init__()
        self.variant = variant
        self.norm = norm
        self.attn = attn
        if variant == "B":
            self.ffn_norm = norm_factory()
            self.ffn = _SwiGLU(d_model, ffn_dim)

    def forward(self, x: torch.Tensor, bank: LatentBank, record: Optional[Callable[[Routing], None]] = None,
                documents: Optional[DocumentSegments] = None):
        out, loss = self.attn(self.norm(x), bank, record, documents)
        x = x + out
        if self.variant == "B":
            x = x + self.ffn(self.ffn_norm(x))
        return x, loss


class CrossAttnMemory(nn.Module):
    """The banks and memory layers of a model with ``memory.type: crossattn`` (module docstring).

    ``parts[str(i)]`` is the :class:`MemoryBlockPart` of decoder layer ``i``; :meth:`bank_for` its bank."""

    def __init__(self, c: CrossAttnConfig, d_model: int, n_heads: int, head_dim: int, n_layers: int,
                 ffn_dim: int, norm_factory):
        super().__init__()
        self.cfg = c
        self.layer_indices = memory_layer_indices(c, n_layers)
        bank_width = c.dim or d_model
        width = c.dim or n_heads * head_dim
        heads = c.heads or n_heads
        n_banks = 1 if c.shared else len(self.layer_indices)
        self.banks = nn.ModuleList(LatentBank(c.tokens, bank_width, c.chapters, c.bank_rank, c.bank_dtype, c.init_std)
                                   for _ in range(n_banks))
        self.parts = nn.ModuleDict({
            str(i): MemoryBlockPart(d_model, norm_factory(), MemoryCrossAttention(
                d_model, bank_width, width, heads, c.chapters, c.top_k, c.routing, c.proj_rank, c.kernel), c.variant,
                c.ffn_dim or ffn_dim, norm_factory)
            for i in self.layer_indices})
        self.stats = RoutingStats(c.chapters, n_banks) if c.top_k else None
        if c.freeze_bank:
            for p in self.bank_parameters():
                p.requires_grad_(False)

    def bank_index(self, layer: int) -> int:
        """The index in :attr:`banks` of decoder layer ``layer``'s bank."""
        return 0 if self.cfg.shared else self.layer_indices.index(layer)

    def bank_for(self, layer: int) -> LatentBank:
        return self.banks[self.bank_index(layer)]

    def recorder(self, layer: int) -> Optional[Callable[[Routing], None]]:
        """What decoder layer ``layer``'s memory read records its routing with (None without routing)."""
        return self.stats.recorder(self.bank_index(layer)) if self.stats is not None else None

    def has(self, layer: int) -> bool:
        return str(layer) in self.parts

    def apply(self, layer, x: Optional[torch.Tensor] = None, documents: Optional[DocumentSegments] = None,
              record: bool = True):
        """Decoder layer ``layer``'s memory read on residual stream ``x``: ``(new x, routing loss)``
        (:meth:`read`). Called with a function alone it is ``nn.Module.apply(fn)``, which this name
        shadows and DeepSpeed's engine set-up calls on every submodule."""
        if x is None and callable(layer):
            return super().apply(layer)
        return self.read(layer, x, documents, record)

    def read(self, layer: int, x: torch.Tensor, documents: Optional[DocumentSegments] = None,
             record: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Decoder layer ``layer``'s memory read on residual stream ``x``: ``(new x, routing loss)``.
        ``documents``: the rows' documents when packed (:meth:`DocumentSegments.of`); ``record``: whether
        the routing statistics count this read (not a recomputation in backward)."""
        return self.parts[str(layer)](x, self.bank_for(layer), self.recorder(layer) if record else None, documents)

    @property
    def pools_sequence(self) -> bool:
        """Whether a memory layer routes on the mean-pooled sequence (``sequence`` routing, eq. 8): a
        position's output then depends on every position of its row, later ones and right padding
        included, so evaluation batches only sequences of equal length
        (:func:`memtrain.eval.common.padding_changes_logits`)."""
        return any(part.attn.router is not None and part.attn.router.mode == "sequence"
                   for part in self.parts.values())

    def bank_parameters(self) -> list[nn.Parameter]:
        """The bank tokens and every layer's ``W_K``, ``W_V`` (Section 5.5: what ``freeze_bank`` and
        ``freeze_bank_at`` freeze and ``bank_lr`` sets)."""
        params = list(self.banks.parameters())
        for part in self.parts.values():
            params += list(part.attn.wk.parameters()) + list(part.attn.wv.parameters())
        return params

    def freeze_bank_gradients(self) -> None:
        """Section 5.5's staged freezing, from ``freeze_bank_at`` on (the trainer calls this at that step, and at
        the start of a run resumed past it): the bank and its W_K, W_V receive zero gradients from then on,
        so the global gradient norm (``optim/grad_norm``) and clipping count only what still trains, as for
        parameters frozen from the start (``freeze_bank``); their learning rate is 0 from that step too (AdamW
        with a rate of 0 moves nothing). Zeros rather than ``requires_grad_(False)``: every ZeRO stage keeps
        its parameter groups. Idempotent."""
        if not getattr(self, "_bank_grad_hooks", None):
            self._bank_grad_hooks = [p.register_hook(torch.zeros_like) for p in self.bank_parameters()
                                     if p.requires_grad]

    def pop_stats(self) -> dict[str, float]:
        """The routing statistics since the last call (empty without routing), then reset."""
        if self.stats is None:
            return {}
        out = self.stats.summary()
        self.stats.reset()
        return out

    def parameter_counts(self) -> dict[str, int]:
        """``bank`` (stored numbers of every bank), ``per_layer`` (one memory layer's projections,
        router and variant-B MLP and norms), ``layers`` (memory layers), ``total``."""
        first = next(iter(self.parts.values()))
        per_layer = sum(p.numel() for p in first.parameters())
        bank = sum(b.parameter_count for b in self.banks)
        return {"bank": bank, "banks": len(self.banks), "per_layer": per_layer, "layers": len(self.parts),
                "total": bank + per_layer * len(self.parts)}


__all__ = ["CrossAttnMemory", "MemoryBlockPart", "MemoryCrossAttention", "RoutingStats", "memory_layer_indices"]
