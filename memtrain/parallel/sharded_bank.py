"""The row-sharded memory bank: owner-computes fetch, sparse gradient traffic, dense-exact AdamW.

Same interface as :class:`memtrain.parallel.bank.MemoryBank` (../shared/DESIGN.md, "The sharded memory
bank"): ``fetch(ids, generic, count) -> FetchedMemory``, ``reduce_gradients()``, ``grad_norm()``,
``scale_gradients(c)``, ``step(lr)``, ``stats()``, ``state_dict()`` / ``load_state_dict()``.

Storage. For every level with r_l > 0, global row ``g`` of ``[0, k^l)`` lives on rank
:meth:`ShardedMemoryBank.owner` ``(level, g)`` (``g % world``, round robin; a cluster-affine map can
replace that one method). Each rank keeps only its rows (fp32), their gradient and their AdamW state
(``exp_avg``, ``exp_avg_sq``), plus the global step count.

Fetch (collective: every rank calls it the same number of times, as the training loop does). Per
level: the unique ids of the micro-batch's non-generic sequences go to their owners (one
``all_to_all_single`` of split sizes, one of ids); owners answer with the rows (one
``all_to_all_single`` of rows); the rows enter the graph through an autograd function whose backward
only *stores* the gradient of each unique row locally, keyed by global id (no communication in
backward, so gradient accumulation is free). Every rank takes part in every level's exchange, even
when all its sequences are generic (it still serves the others).

``reduce_gradients`` (accumulation boundary, collective): per level, the locally accumulated
``(id, grad)`` pairs are coalesced and sent to their owners (all-to-all); owners sum them over ranks
and micro-batches into their shard's gradient and divide by the world size (DeepSpeed averages the
anchor's gradients over ranks, and :class:`MemoryBank` averages the bank's; this keeps that mean).

``step(lr)``, no communication:

- ``mode="dense"`` (default): every owned row is updated exactly as ``torch.optim.AdamW``
  (single-tensor path) would update the whole table: decoupled weight decay, bias correction by the
  global step count, ``eps`` added to the bias-corrected root; rows no rank fetched have zero gradient,
  so they decay and follow their momentum. (``torch.optim.AdamW`` skips a table whose ``.grad`` is
  None; this bank never skips: a table no rank touched in a step is still stepped with zero gradient,
  as :class:`MemoryBank` does.)
- ``mode="lazy"``: torch.optim.SparseAdam semantics: only rows that received a gradient entry this
  step (fetched by some sequence on some rank, even when the value is 0) update ``exp_avg``,
  ``exp_avg_sq`` and the row; untouched rows keep value and state. Bias correction uses the global
  step count (SparseAdam keeps one count per parameter, incremented on every step with a gradient;
  here every step counts, which is the same whenever every table gets a gradient every step). No
  weight decay (SparseAdam has none): :meth:`build_optimizer` rejects ``weight_decay != 0`` in lazy
  mode rather than ignore it. ``eps`` is added to the *uncorrected* root and the bias corrections
  folded into the step size, exactly as SparseAdam.

Counters (:meth:`stats`, :meth:`comm_bytes`). Every all-to-all payload this rank sends and receives
(split sizes, id requests, rows, gradient ids and values) is counted in bytes, excluding the part a
rank sends to itself (no wire). Only fetches with ``count=True`` (training) count. ``step()`` closes
the window: ``comm/bank_bytes_sent`` / ``comm/bank_bytes_received`` report the last step's totals for
this rank. The scalar all-reduces of :meth:`grad_norm` and :meth:`stats` are not counted.

Initialisation equals ``MemoryBank(layout, seed=s)`` row for row: each rank generates the whole level
with the same per-level generator and keeps its rows. That costs a full table of memory and time per
rank, fine for tests and small banks; for multi-billion-parameter banks, use a generator per row (seed
derived from ``(seed, level, row)``) so each owner draws only its rows -- a different, but equally
rank-independent, initialisation (not implemented here).
"""

from __future__ import annotations

from typing import Optional

import torch

from memtrain.model.hierarchical import FetchedMemory, MemoryLayout
from memtrain.parallel.bank import per_sequence_rows

_ID_DTYPE = torch.int64


def _dist():
    d = torch.distributed
    return d if (d.is_available() and d.is_initialized()) else None


class _FetchedRows(torch.autograd.Function):
    """Rows received from their owners -> a differentiable ``[U, s_l]`` tensor. Backward stores the
    gradient of each unique row on the bank (keyed by global id) and communicates nothing."""

    @staticmethod
    def forward(ctx, rows, token, bank, level, uniq):  # noqa: D401 - autograd signature
        ctx.bank, ctx.level, ctx.uniq = bank, level, uniq
        return rows

    @staticmethod
    def backward(ctx, grad):
        ctx.bank._pending[ctx.level].append((ctx.uniq, grad.detach().to(torch.float32)))
        return None, None, None, None, None


class ShardedMemoryBank:
    """Row tables ``[k^l, s_l]`` sharded by rows over the data-parallel ranks (module docstring)."""

    MODES = ("dense", "lazy")

    def __init__(self, layout: MemoryLayout, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 seed: int = 0, mode: str = "dense", group=None, subtree_ranks: Optional[list[list[int]]] = None):
        """``subtree_ranks[s]``: the ranks that read level-1 subtree ``s`` (cluster-affine placement,
        :func:`memtrain.data.loader.affine_groups`; every subtree the same number of ranks). Then a row
        of any level is owned by one of the ranks of its level-1 ancestor, so its traffic never leaves
        that group; None: round robin over all ranks."""
        if mode not in self.MODES:
            raise ValueError(f"sharded bank mode must be one of {self.MODES}, got {mode!r}")
        if dtype != torch.float32:
            raise ValueError(f"the sharded bank stores fp32 rows (with fp32 AdamW state), got {dtype}")
        self.layout = layout
        self.device = torch.device(device)
        self.mode = mode
        self.group = group
        d = _dist()
        self.world = d.get_world_size(group) if d is not None else 1
        self.rank = d.get_rank(group) if d is not None else 0
        self._subtree_ranks: Optional[torch.Tensor] = None
        if subtree_ranks is not None:
            k = layout.branching
            sizes = {len(r) for r in subtree_ranks}
            if len(subtree_ranks) != k or len(sizes) != 1 or any(not 0 <= x < self.world for r in subtree_ranks
                                                                  for x in r):
                raise ValueError(f"subtree_ranks must give the same number of ranks in [0, {self.world}) for each "
                                 f"of the {k} level-1 subtrees; got {subtree_ranks}")
            self._subtree_ranks = torch.tensor(subtree_ranks, dtype=_ID_DTYPE, device=self.device)
        self.owned: list[Optional[torch.Tensor]] = []  # sorted global ids of this rank's rows
        self.shards: list[Optional[torch.Tensor]] = []  # [n_owned, s_l] fp32
        for level in range(layout.depth):
            if layout.levels[level] == 0:
                self.owned.append(None)
                self.shards.append(None)
                continue
            n = layout.rows(level)
            all_ids = torch.arange(n, dtype=_ID_DTYPE, device=self.device)
            mine = all_ids[self.owner(level, all_ids) == self.rank]
            full = torch.empty(n, layout.block_size(level), dtype=torch.float32, device=self.device)
            # The same generator as MemoryBank: identical initial values (see the module docstring for
            # the cost of drawing the whole level on every rank).
            gen = torch.Generator(device=self.device).manual_seed(seed * 1000 + level)
            layout.init_rows(full, level, gen)
            self.owned.append(mine)
            self.shards.append(full.index_select(0, mine).contiguous())
            del full
        self.grads: list[Optional[torch.Tensor]] = [None] * layout.depth
        self.exp_avg: list[Optional[torch.Tensor]] = [None] * layout.depth
        self.exp_avg_sq: list[Optional[torch.Tensor]] = [None] * layout.depth
        self._step = 0
        self.hparams: Optional[dict] = None
        self._token = torch.zeros((), requires_grad=True)  # makes fetched rows part of the graph
        self._pending: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(layout.depth)]
        self._touched_grad: list[Optional[torch.Tensor]] = [None] * layout.depth  # lazy: rows with a grad entry
        self._reduced = False
        self._bytes = [0, 0]  # sent, received since the last step
        self._micro = 0  # counted fetches since the last step
        self._last = {"sent": 0, "received": 0, "micro_batches": 0}
        self._reset_counters()

    # -- placement ---------------------------------------------------------------------------------

    def owner(self, level: int, row: torch.Tensor | int) -> torch.Tensor | int:
        """Rank that stores global ``row`` of ``level`` (0-based): round robin, ``row % world``.

        The only place that decides placement: everything else (init, fetch routing, gradient routing,
        state dicts) goes through it and :attr:`owned`, so a cluster-affine map (a level-1 subtree's
        rows on a fixed group of ranks) can replace it. It must be a pure function of (level, row)
        that every rank evaluates identically. With ``subtree_ranks`` (cluster-affine), the row's owner is
        one of the ranks reading its level-1 ancestor (``row // k^level``), round robin among them."""
        if self._subtree_ranks is None:
            return row % self.world
        ranks = self._subtree_ranks
        ancestor = row // self.layout.branching ** level
        return ranks[ancestor, row % ranks.shape[1]] if isinstance(row, torch.Tensor) else \
            int(ranks[ancestor, row % ranks.shape[1]])

    def _local_index(self, level: int, rows: torch.Tensor) -> torch.Tensor:
        """Global ids owned by this rank -> positions in this rank's shard."""
        return torch.searchsorted(self.owned[level], rows)

    # -- parameters and optimizer ------------------------------------------------------------------

    def parameters(self) -> list[torch.Tensor]:
        """This rank's shards (not ``nn.Parameter``s; gradients live in :attr:`grads`)."""
        return [s for s in self.shards if s is not None]

    def numel(self) -> int:
        """Parameters of the whole bank (all ranks), as :meth:`MemoryBank.numel`."""
        return sum(self.layout.rows(l) * self.layout.block_size(l) for l in range(self.layout.depth)
                   if self.shards[l] is not None)

    def build_optimizer(self, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
        if self.mode == "lazy" and weight_decay != 0:
            raise ValueError("the lazy sharded bank follows torch.optim.SparseAdam, which has no weight decay; "
                             f"got weight_decay={weight_decay} (use mode='dense' or weight_decay 0)")
        self.hparams = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        for l, s in enumerate(self.shards):
            if s is not None and self.exp_avg[l] is None:
                self.exp_avg[l] = torch.zeros_like(s)
                self.exp_avg_sq[l] = torch.zeros_like(s)

    def requires_grad_(self, flag: bool) -> "ShardedMemoryBank":
        self._token.requires_grad_(flag)
        return self

    # -- communication -----------------------------------------------------------------------------

    def _exchange(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int],
                  count: bool) -> torch.Tensor:
        """all_to_all_single along dim 0 with known split sizes; counts off-rank bytes."""
        row_bytes = send.element_size()
        for n in send.shape[1:]:
            row_bytes *= n
        out = send.new_empty((sum(recv_splits), *send.shape[1:]))
        d = _dist()
        if d is None or self.world == 1:
            out.copy_(send)
        else:
            d.all_to_all_single(out, send.contiguous(), recv_splits, send_splits, group=self.group)
        if count:
            self._bytes[0] += row_bytes * (sum(send_splits) - send_splits[self.rank])
            self._bytes[1] += row_bytes * (sum(recv_splits) - recv_splits[self.rank])
        return out

    def _exchange_splits(self, send_splits: list[int], count: bool) -> list[int]:
        t = torch.tensor(send_splits, dtype=_ID_DTYPE, device=self.device)
        out = self._exchange(t, [1] * self.world, [1] * self.world, count)
        return [int(v) for v in out.tolist()]

    def _route(self, level: int, ids: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Order of ``ids`` grouped by owner (stable), and the number going to each rank."""
        own = self.owner(level, ids)
        order = torch.sort(own, stable=True).indices
        splits = torch.bincount(own, minlength=self.world).tolist() if ids.numel() else [0] * self.world
        return order, splits

    # -- fetch -------------------------------------------------------------------------------------

    def fetch(self, ids: torch.Tensor, generic: Optional[torch.Tensor] = None, count: bool = True) -> FetchedMemory:
        """As :meth:`MemoryBank.fetch`; collective over the data-parallel group (module docstring).

        Bad ids raise ValueError on the rank that has them *and* on every other rank (the error travels
        with the split sizes of the first exchange, so no rank is left waiting in a collective)."""
        layout = self.layout
        if ids.dim() != 2 or ids.shape[1] != layout.depth:
            raise ValueError(f"cluster ids must be [batch, {layout.depth}] (one id per level), got {tuple(ids.shape)}")
        B = ids.shape[0]
        ids = ids.to(self.device)
        used = torch.ones(B, dtype=torch.bool, device=self.device) if generic is None else ~generic.to(self.device)
        error = None
        for level, shard in enumerate(self.shards):
            if shard is None or B == 0:
                continue
            col, n = ids[:, level], layout.rows(level)
            if int(col.min()) < 0 or int(col.max()) >= n:
                error = (f"level-{level + 1} cluster ids must lie in [0, {n}); got "
                         f"[{int(col.min())}, {int(col.max())}]")
                break
        if count:
            self._counts += torch.tensor([B, B - int(used.sum())], dtype=torch.float64)
            self._micro += 1
        levels: list[Optional[torch.Tensor]] = []
        first = True
        for level, shard in enumerate(self.shards):
            if shard is None:
                levels.append(None)
                continue
            uniq, inverse = torch.unique(ids[used, level], return_inverse=True)
            order, splits = self._route(level, uniq)
            if first:  # every rank learns of any rank's bad ids here
                first = False
                recv_splits = self._exchange_splits([-1] * self.world if error else splits, count)
                if error:
                    raise ValueError(error)
                if any(s < 0 for s in recv_splits):
                    raise ValueError("another data-parallel rank passed cluster ids out of range to the memory bank")
            else:
                recv_splits = self._exchange_splits(splits, count)
            requests = self._exchange(uniq[order], splits, recv_splits, count)
            if count and requests.numel():
                self._touched[level][self._local_index(level, requests)] = True
            served = shard.index_select(0, self._local_index(level, requests))
            got = self._exchange(served, recv_splits, splits, count)  # rows in `order` order
            rows = torch.empty_like(got)
            rows[order] = got
            if not bool(used.any()):
                levels.append(None)
                continue
            rows = _FetchedRows.apply(rows, self._token, self, level, uniq)
            levels.append(per_sequence_rows(rows, inverse, used))
        return FetchedMemory(levels=levels, generic=generic.to(self.device) if generic is not None else None,
                             ids=ids)

    # -- after backward ----------------------------------------------------------------------------

    def reduce_gradients(self) -> None:
        """Send every accumulated row gradient to its owner; owners sum over ranks and micro-batches and
        divide by the world size (collective; counted)."""
        for level, shard in enumerate(self.shards):
            if shard is None:
                continue
            pending = self._pending[level]
            if pending:
                all_ids = torch.cat([p[0] for p in pending])
                uniq, inverse = torch.unique(all_ids, return_inverse=True)
                grads = torch.zeros(len(uniq), shard.shape[1], dtype=torch.float32, device=self.device)
                grads.index_add_(0, inverse, torch.cat([p[1] for p in pending]))
            else:
                uniq = torch.empty(0, dtype=_ID_DTYPE, device=self.device)
                grads = torch.empty(0, shard.shape[1], dtype=torch.float32, device=self.device)
            self._pending[level] = []
            order, splits = self._route(level, uniq)
            recv_splits = self._exchange_splits(splits, True)
            got_ids = self._exchange(uniq[order], splits, recv_splits, True)
            got = self._exchange(grads[order], splits, recv_splits, True)
            if self.grads[level] is None:
                self.grads[level] = torch.zeros_like(shard)
                self._touched_grad[level] = torch.zeros(shard.shape[0], dtype=torch.bool, device=self.device)
            local = self._local_index(level, got_ids)
            if self.world > 1:
                got = got / self.world
            self.grads[level].index_add_(0, local, got)
            self._touched_grad[level][local] = True
        self._reduced = True

    def _sq_norms(self) -> list[float]:
        return [float(g.double().square().sum()) if g is not None else 0.0 for g in self.grads]

    def _all_reduce(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        d = _dist()
        if d is not None and self.world > 1:
            d.all_reduce(t, group=self.group)
        return t.tolist()

    def grad_norm(self) -> float:
        """Global L2 norm of the bank's gradient (after :meth:`reduce_gradients`; all-reduce of the sum
        of squares, collective)."""
        return sum(self._all_reduce([sum(self._sq_norms())])) ** 0.5

    def scale_gradients(self, coef: float) -> None:
        for g in self.grads:
            if g is not None:
                g.mul_(coef)

    def step(self, lr: float) -> None:
        """One optimizer step at ``lr`` on this rank's rows (no communication unless gradients were not
        reduced yet), then clear the gradients and close the byte-count window."""
        if self.hparams is None:
            raise RuntimeError("call build_optimizer() before step()")
        if not self._reduced:
            self.reduce_gradients()
        beta1, beta2 = self.hparams["betas"]
        eps, wd = self.hparams["eps"], self.hparams["weight_decay"]
        self._step += 1
        step = self._step
        bias_correction1 = 1 - beta1 ** step
        bias_correction2 = 1 - beta2 ** step
        with torch.no_grad():
            for l, p in enumerate(self.shards):
                if p is None:
                    continue
                grad = self.grads[l] if self.grads[l] is not None else torch.zeros_like(p)
                m, v = self.exp_avg[l], self.exp_avg_sq[l]
                if self.mode == "dense":  # torch.optim.AdamW, single-tensor path, op for op
                    if wd != 0:
                        p.mul_(1 - lr * wd)
                    m.lerp_(grad, 1 - beta1)
                    v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                    denom = (v.sqrt() / bias_correction2 ** 0.5).add_(eps)
                    p.addcdiv_(m, denom, value=-(lr / bias_correction1))
                else:  # torch.optim.SparseAdam on the touched rows, op for op
                    touched = self._touched_grad[l]
                    if touched is None or not bool(touched.any()):
                        continue
                    rows = touched.nonzero().flatten()
                    g = grad.index_select(0, rows)
                    old_m, old_v = m.index_select(0, rows), v.index_select(0, rows)
                    m_upd = g.sub(old_m).mul_(1 - beta1)
                    m.index_add_(0, rows, m_upd)
                    v_upd = g.pow(2).sub_(old_v).mul_(1 - beta2)
                    v.index_add_(0, rows, v_upd)
                    numer = m_upd.add_(old_m)
                    v_upd.add_(old_v)
                    denom = v_upd.sqrt_().add_(eps)
                    step_size = lr * bias_correction2 ** 0.5 / bias_correction1
                    p.index_add_(0, rows, -step_size * numer.div_(denom))
        self.grads = [None] * self.layout.depth
        self._touched_grad = [None] * self.layout.depth
        self._reduced = False
        self._last = {"sent": self._bytes[0], "received": self._bytes[1], "micro_batches": self._micro}
        self._bytes = [0, 0]
        self._micro = 0

    # -- counters ----------------------------------------------------------------------------------

    def comm_bytes(self) -> dict[str, int]:
        """This rank's bank traffic in the last completed step: ``sent``, ``received`` (bytes) and the
        number of counted fetches (``micro_batches``)."""
        return dict(self._last)

    def zero3_reference_bytes(self, micro_batches: Optional[int] = None) -> int:
        """Bytes one rank would send (and, symmetrically, receive) per step if the same bank were an
        ordinary ZeRO-3 parameter: per micro-batch, an all-gather of the whole bank for forward, another
        for backward, and a reduce-scatter of its gradient, each moving ``(W - 1) / W`` of the bank per
        rank (ring algorithms), in the bank's fp32::

            3 * m * (W - 1) / W * P * 4,   P = sum_l k^l s_l (bank parameters), W = world size,

        ``m`` = micro-batches per step (default: the counted fetches of the last step, at least 1).
        """
        m = micro_batches if micro_batches is not None else max(self._last["micro_batches"], 1)
        P = sum(self.layout.rows(l) * self.layout.block_size(l) for l in range(self.layout.depth)
                if self.shards[l] is not None)
        return 3 * m * (self.world - 1) * P * 4 // self.world

    def _reset_counters(self) -> None:
        self._touched = [torch.zeros(s.shape[0] if s is not None else 0, dtype=torch.bool, device=self.device)
                         for s in self.shards]
        self._counts = torch.zeros(2, dtype=torch.float64)  # sequences, generic sequences

    def stats(self, norms: bool = True, reset: bool = True) -> dict[str, float]:
        """:meth:`MemoryBank.stats`'s keys (over all ranks: one all-reduce; collective) plus this rank's
        ``comm/bank_bytes_sent`` / ``comm/bank_bytes_received`` of the last step and
        ``comm/bank_zero3_bytes`` (:meth:`zero3_reference_bytes`)."""
        active = [l for l, s in enumerate(self.shards) if s is not None]
        local = [float(self._touched[l].sum()) for l in active]
        local += [float(self.shards[l].double().square().sum()) for l in active] if norms else []
        local += self._counts.tolist()
        total = self._all_reduce(local)
        n = len(active)
        out: dict[str, float] = {}
        n_touched = n_rows = 0
        for i, l in enumerate(active):
            rows = self.layout.rows(l)
            out[f"memory_module/rows_touched_frac/level{l + 1}"] = total[i] / rows
            if norms:
                out[f"memory_module/param_norm/level{l + 1}"] = total[n + i] ** 0.5
            n_touched += int(total[i])
            n_rows += rows
        if n_rows:
            out["memory_module/rows_touched_frac/all"] = n_touched / n_rows
        seqs, gen = total[-2], total[-1]
        if seqs > 0:
            out["memory_module/generic_rate"] = gen / seqs
        out["comm/bank_bytes_sent"] = float(self._last["sent"])
        out["comm/bank_bytes_received"] = float(self._last["received"])
        out["comm/bank_zero3_bytes"] = float(self.zero3_reference_bytes())
        if reset:
            self._reset_counters()
        return out

    # -- checkpoints -------------------------------------------------------------------------------

    def _meta(self) -> dict:
        return {"levels": list(self.layout.levels), "branching": self.layout.branching,
                "block_sizes": [self.layout.block_size(l) for l in range(self.layout.depth)]}

    def state_dict(self) -> dict:
        """This rank's rows keyed by global row id: per level ``ids`` (global), ``rows``, ``exp_avg``,
        ``exp_avg_sq``; plus ``step``, ``mode``, ``hparams`` and the layout's shape."""
        levels = {}
        for l, s in enumerate(self.shards):
            if s is None:
                continue
            levels[str(l)] = {"ids": self.owned[l].cpu(), "rows": s.cpu().clone(),
                              "exp_avg": self.exp_avg[l].cpu().clone() if self.exp_avg[l] is not None else None,
                              "exp_avg_sq": self.exp_avg_sq[l].cpu().clone() if self.exp_avg_sq[l] is not None
                              else None}
        return {"format": "sharded_bank/v1", "levels_state": levels, "step": self._step, "mode": self.mode,
                "hparams": self.hparams, **self._meta()}

    def load_state_dict(self, state: dict) -> None:
        """Load from any state whose per-level ``ids`` cover this rank's rows (this rank's own state, or
        :meth:`gather_full_state` saved under any world size: resharding), or from a
        :meth:`MemoryBank.state_dict` (rows, AdamW moments and step)."""
        want = (list(self.layout.levels), self.layout.branching)
        got = (list(state.get("levels", [])), state.get("branching"))
        if want != got:
            raise ValueError(f"bank was saved with levels {got[0]} and branching {got[1]}; this bank has "
                             f"levels {want[0]} and branching {want[1]}")
        if "levels_state" not in state:
            state = self._from_memory_bank_state(state)
        for l, s in enumerate(self.shards):
            if s is None:
                continue
            entry = state["levels_state"][str(l)]
            ids = entry["ids"].to(self.device)
            order = torch.argsort(ids)
            sorted_ids = ids[order]
            pos = torch.searchsorted(sorted_ids, self.owned[l]).clamp_max(max(len(ids) - 1, 0))
            if len(ids) == 0 or not torch.equal(sorted_ids[pos], self.owned[l]):
                raise ValueError(f"level-{l + 1} state lacks rows owned by rank {self.rank}")
            take = order[pos]
            s.copy_(entry["rows"].to(self.device).index_select(0, take))
            if entry.get("exp_avg") is not None:
                self.exp_avg[l] = entry["exp_avg"].to(self.device).index_select(0, take).clone()
                self.exp_avg_sq[l] = entry["exp_avg_sq"].to(self.device).index_select(0, take).clone()
        self._step = int(state.get("step", 0))
        if state.get("hparams") is not None and self.hparams is None:
            self.hparams = dict(state["hparams"])

    def _from_memory_bank_state(self, state: dict) -> dict:
        """:meth:`MemoryBank.state_dict` (full ``tables`` and a torch AdamW state, whose keys are the
        tables' positions among the active levels) -> this class's format, every row id present."""
        levels, step = {}, 0
        opt = (state.get("optimizer") or {}).get("state", {})
        for i, l in enumerate(l for l, s in enumerate(self.shards) if s is not None):
            table = state["tables"][str(l)]
            st = opt.get(i, {})
            levels[str(l)] = {"ids": torch.arange(table.shape[0], dtype=_ID_DTYPE), "rows": table,
                              "exp_avg": st.get("exp_avg"), "exp_avg_sq": st.get("exp_avg_sq")}
            if "step" in st:
                step = int(st["step"])
        return {**state, "levels_state": levels, "step": step}

    def gather_full_state(self) -> dict:
        """The whole bank on every rank (collective; all_gather_object of every rank's
        :meth:`state_dict`, so it needs the full bank in memory: for tests, small banks and resharding).
        Same format as :meth:`state_dict` with every row id, plus ``tables`` / ``exp_avg`` /
        ``exp_avg_sq``: ``{str(level): full [k^l, s_l] tensor}`` in global row order, so
        :meth:`MemoryBank.load_state_dict` also accepts it (rows only: evaluation)."""
        mine = self.state_dict()
        d = _dist()
        if d is not None and self.world > 1:
            parts: list = [None] * self.world
            d.all_gather_object(parts, mine, group=self.group)
        else:
            parts = [mine]
        return merge_states(parts)


def merge_states(parts: list[dict]) -> dict:
    """Per-rank :meth:`ShardedMemoryBank.state_dict` s (from any world size, e.g. the shard files of a
    checkpoint) -> one state with every row id, loadable by a bank of any world size and, through its
    ``tables`` (full ``[k^l, s_l]`` in global row order), by :class:`MemoryBank` (rows only)."""
    first = parts[0]
    levels, tables, exp_avg, exp_avg_sq = {}, {}, {}, {}
    for key in first["levels_state"]:
        ids = torch.cat([p["levels_state"][key]["ids"] for p in parts])
        order = torch.argsort(ids)
        entry = {"ids": ids[order]}
        for name in ("rows", "exp_avg", "exp_avg_sq"):
            vals = [p["levels_state"][key][name] for p in parts]
            entry[name] = torch.cat(vals)[order] if all(v is not None for v in vals) else None
        levels[key] = entry
        tables[key], exp_avg[key], exp_avg_sq[key] = entry["rows"], entry["exp_avg"], entry["exp_avg_sq"]
    return {**first, "levels_state": levels, "tables": tables, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


__all__ = ["ShardedMemoryBank", "merge_states"]
