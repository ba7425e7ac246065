"""The memory bank: one row table per level, fetched per sequence, stepped after backward.

Interface (../shared/DESIGN.md, "Interfaces worth keeping stable"): ``fetch(ids, generic) ->
FetchedMemory`` (differentiable per-sequence rows), ``reduce_gradients()`` / ``step(lr)`` after
backward, ``state_dict()`` / ``load_state_dict()``, and counters (:meth:`stats`).

This is the single-process form: every data-parallel rank holds the whole bank (replicated, seeded
identically) and averages the bank's gradients over ranks with one all-reduce per optimizer step.
Rows live outside the module handed to DeepSpeed, so ZeRO never gathers or partitions them. The
optimizer is torch's AdamW over the whole tables, i.e. dense AdamW: rows a step did not fetch still
decay and follow their momentum (their gradient is zero, never skipped). A row-sharded bank with
sparse communication keeps this interface.

Fetch: per level, the unique ids of the micro-batch's non-generic sequences are gathered once
(``index_select``: gradients reach exactly those rows), then expanded to one row per sequence.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from memtrain.model.hierarchical import FetchedMemory, MemoryLayout


def per_sequence_rows(rows: torch.Tensor, inverse: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
    """A level's unique fetched rows ``[U, s_l]`` -> one row per sequence ``[B, s_l]``: sequence ``b``
    with ``used[b]`` gets ``rows[inverse[i]]`` (its position among the used ones), generic sequences a
    zero row that the model replaces by the generic block."""
    rows = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
    index = torch.full((used.shape[0],), rows.shape[0] - 1, dtype=torch.long, device=rows.device)
    index[used] = inverse
    return rows.index_select(0, index)


def fetch_inputs(layout: MemoryLayout, ids: torch.Tensor, generic: Optional[torch.Tensor],
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor, Optional[str]]:
    """Shared checks of both banks' ``fetch``: ``ids [B, p]`` on ``device``, the mask of sequences that
    fetch (not generic), and the message for ids outside ``[0, k^l)`` at the first active level that
    has some (None when all lie in range). A wrong shape raises ValueError here."""
    if ids.dim() != 2 or ids.shape[1] != layout.depth:
        raise ValueError(f"cluster ids must be [batch, {layout.depth}] (one id per level), got {tuple(ids.shape)}")
    B = ids.shape[0]
    ids = ids.to(device)
    used = torch.ones(B, dtype=torch.bool, device=device) if generic is None else ~generic.to(device)
    for level in layout.active_levels if B else ():
        col, n = ids[:, level], layout.rows(level)
        if int(col.min()) < 0 or int(col.max()) >= n:
            return ids, used, (f"level-{level + 1} cluster ids must lie in [0, {n}); got "
                               f"[{int(col.min())}, {int(col.max())}]")
    return ids, used, None


class MemoryBank:
    """Row tables ``[k^l, s_l]`` for every level with r_l > 0 (see the module docstring)."""

    def __init__(self, layout: MemoryLayout, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 seed: int = 0):
        self.layout = layout
        self.device = torch.device(device)
        self.tables: list[Optional[nn.Parameter]] = []
        for level in range(layout.depth):
            if layout.levels[level] == 0:
                self.tables.append(None)
                continue
            table = nn.Parameter(torch.empty(layout.rows(level), layout.block_size(level), dtype=dtype,
                                             device=self.device))
            # One generator per level: the bank's initial values depend on the seed alone, not on what
            # else drew from the global RNG before, so every rank builds the same bank. A CPU generator
            # (draws copied to the device): the values do not depend on the device either, and the
            # sharded bank draws the same stream in row chunks (ShardedMemoryBank, "Initialisation").
            gen = torch.Generator().manual_seed(seed * 1000 + level)
            layout.init_rows(table.data, level, gen)
            self.tables.append(table)
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self._last_bytes = (0, 0)  # the last gradient all-reduce's bytes, this rank: (sent, received)
        self._reset_counters()

    # -- parameters and optimizer ------------------------------------------------------------------

    def parameters(self) -> list[nn.Parameter]:
        return [t for t in self.tables if t is not None]

    def numel(self) -> int:
        return sum(t.numel() for t in self.parameters())

    def build_optimizer(self, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
        """Dense AdamW over every row (untouched rows decay and follow their momentum)."""
        self.optimizer = torch.optim.AdamW(self.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                           foreach=False)

    def requires_grad_(self, flag: bool) -> "MemoryBank":
        for t in self.parameters():
            t.requires_grad_(flag)
        return self

    # -- fetch -------------------------------------------------------------------------------------

    def fetch(self, ids: torch.Tensor, generic: Optional[torch.Tensor] = None, count: bool = True) -> FetchedMemory:
        """``ids [B, p]``: global cluster id per level (level l in [0, k^l)); ``generic [B]`` bool: those
        sequences use the generic memory, so their rows are neither fetched nor counted. ``count``:
        include this fetch in :meth:`stats` (training fetches; evaluation passes False)."""
        ids, used, error = fetch_inputs(self.layout, ids, generic, self.device)
        if error and bool(used.any()):
            raise ValueError(error)
        B = ids.shape[0]
        if count:
            self._counts += torch.tensor([B, B - int(used.sum())], dtype=torch.float64)
        levels: list[Optional[torch.Tensor]] = []
        for level, table in enumerate(self.tables):
            if table is None or not bool(used.any()):
                levels.append(None)
                continue
            uniq, inverse = torch.unique(ids[used, level], return_inverse=True)
            if count:
                self._touched[level][uniq] = True
            rows = table.index_select(0, uniq)  # [U, s_l]: gradients reach these rows only
            levels.append(per_sequence_rows(rows, inverse, used))
        return FetchedMemory(levels=levels, generic=generic.to(self.device) if generic is not None else None,
                             ids=ids)

    # -- after backward ----------------------------------------------------------------------------

    def reduce_gradients(self) -> None:
        """Average the bank's gradients over data-parallel ranks (a no-op in a world of one), and count the
        bytes this rank sends and receives for it (the all-reduce's ring volume, 2 (W - 1) / W of every table's
        gradient: :func:`memtrain.parallel.comm.wire_bytes`), reported by :meth:`stats`."""
        from memtrain.parallel.comm import wire_bytes

        dist = torch.distributed
        self._last_bytes = (0, 0)
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        world, rank = dist.get_world_size(), dist.get_rank()
        sent = received = 0
        for t in self.parameters():
            if t.grad is None:
                t.grad = torch.zeros_like(t)
            _, out, into = wire_bytes("all_reduce", {"tensor": t.grad}, world, rank)
            sent, received = sent + out, received + into
            dist.all_reduce(t.grad)
            t.grad.div_(world)
        self._last_bytes = (sent, received)

    def grad_norm(self) -> float:
        grads = [t.grad for t in self.parameters() if t.grad is not None]
        return float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0

    def scale_gradients(self, coef: float) -> None:
        for t in self.parameters():
            if t.grad is not None:
                t.grad.mul_(coef)

    def step(self, lr: float) -> None:
        """One AdamW step at ``lr`` over every row, then clear the gradients."""
        if self.optimizer is None:
            raise RuntimeError("call build_optimizer() before step()")
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        for t in self.parameters():
            if t.grad is None:  # no sequence fetched this level: still a dense step (decay, momentum)
                t.grad = torch.zeros_like(t)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def skip_step(self) -> None:
        """Drop this step's gradients without an update (a step the divergence guard skips)."""
        for t in self.parameters():
            t.grad = None

    # -- counters ----------------------------------------------------------------------------------

    def _reset_counters(self) -> None:
        self._touched = [torch.zeros(t.shape[0] if t is not None else 0, dtype=torch.bool, device=self.device)
                         for t in self.tables]
        self._counts = torch.zeros(2, dtype=torch.float64)  # sequences, generic sequences

    def stats(self, norms: bool = True, reset: bool = True) -> dict[str, float]:
        """TensorBoard scalars ``memory_module/*`` since the last reset, over all data-parallel ranks:
        the fraction of bank rows touched per level and overall, the generic-memory rate, (with ``norms``)
        the parameter norm of every level's table, and this rank's ``comm/bank_bytes_sent`` /
        ``comm/bank_bytes_received`` of the last gradient all-reduce (:meth:`reduce_gradients`)."""
        dist = torch.distributed
        touched = [m.to(torch.uint8) for m in self._touched]
        counts = self._counts.clone()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            for m in touched:
                if m.numel():
                    dist.all_reduce(m, op=dist.ReduceOp.MAX)
            counts_dev = counts.to(self.device)
            dist.all_reduce(counts_dev)
            counts = counts_dev.cpu()
        out: dict[str, float] = {}
        n_touched = n_rows = 0
        for level, table in enumerate(self.tables):
            if table is None:
                continue
            n = int(touched[level].sum())
            out[f"memory_module/rows_touched_frac/level{level + 1}"] = n / table.shape[0]
            if norms:
                out[f"memory_module/param_norm/level{level + 1}"] = float(table.detach().float().norm())
            n_touched += n
            n_rows += table.shape[0]
        if n_rows:
            out["memory_module/rows_touched_frac/all"] = n_touched / n_rows
        if counts[0] > 0:
            out["memory_module/generic_rate"] = float(counts[1] / counts[0])
        # the last step's gradient all-reduce, this rank (the sharded bank reports its all-to-alls the same way)
        sent, received = self._last_bytes
        out["comm/bank_bytes_sent"], out["comm/bank_bytes_received"] = float(sent), float(received)
        if reset:
            self._reset_counters()
        return out

    # -- checkpoints -------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {
            "tables": {str(l): t.detach().cpu() for l, t in enumerate(self.tables) if t is not None},
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "levels": list(self.layout.levels), "block_sizes": [self.layout.block_size(l) for l in range(self.layout.depth)],
            "branching": self.layout.branching,
        }

    def load_state_dict(self, state: dict) -> None:
        want = (list(self.layout.levels), self.layout.branching)
        got = (list(state.get("levels", [])), state.get("branching"))
        if want != got:
            raise ValueError(f"bank was saved with levels {got[0]} and branching {got[1]}; this bank has "
                             f"levels {want[0]} and branching {want[1]}")
        with torch.no_grad():
            for l, t in enumerate(self.tables):
                if t is not None:
                    t.copy_(state["tables"][str(l)].to(t.device, t.dtype))
        if state.get("optimizer") is not None and self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])


def bank_bytes(layout: MemoryLayout, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of the bank's parameters in ``dtype`` (without optimizer state)."""
    return layout.bank_parameters * torch.empty((), dtype=dtype).element_size()


def level_sizes_line(layout: MemoryLayout) -> str:
    """``(r_1, ..., r_p) x c0`` with the fetched and bank sizes, for logs."""
    return (f"memory {layout.kind} levels {tuple(layout.levels)} x c0 {layout.c0:,}: fetched "
            f"{layout.fetched_parameters:,} | bank {layout.bank_parameters:,} parameters "
            f"({bank_bytes(layout) / 2**30:.2f} GiB fp32)")


__all__ = ["MemoryBank", "bank_bytes", "fetch_inputs", "level_sizes_line", "per_sequence_rows"]
