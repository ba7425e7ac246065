"""The row-sharded memory bank: owner-computes fetch, sparse gradient traffic, dense-exact AdamW.

Same interface as :class:`memtrain.parallel.bank.MemoryBank` (../shared/DESIGN.md, "The sharded memory
bank"): ``fetch(ids, generic, count) -> FetchedMemory``, ``reduce_gradients()``, ``grad_norm()``,
``scale_gradients(c)``, ``step(lr)``, ``stats()``, ``state_dict()`` / ``load_state_dict()``.

Storage. For every level with r_l > 0, global row ``g`` of ``[0, k^l)`` lives on rank
:meth:`ShardedMemoryBank.owner` ``(level, g)`` (``g % world``, round robin; a cluster-affine map can
replace that one method). Each rank keeps only its rows, their gradient and their AdamW state
(``exp_avg``, ``exp_avg_sq``), the step up to which each row is current (``last_step``, see
``mode="deferred"``), plus the global step count.

- Storage dtype (``dtype``): float32 or bfloat16 rows. The AdamW moments and the gradients are always
  fp32. A bf16 bank updates in fp32 on the upcast rows (the same ops as an fp32 bank, in every mode)
  and rounds the result to bf16 (round to nearest even) after every step; there is no fp32 master
  copy. Rows cross the all-to-all in the storage dtype (bf16: half the fetch bytes); gradients cross
  and are summed in fp32. :meth:`fetch` casts the received rows to ``compute_dtype`` (default: the
  storage dtype) *after* communication and after giving each sequence its row, so the model's gradient
  arrives in ``compute_dtype`` and the sequences sharing a row have their gradients summed in fp32.
- CPU offload (``offload=True``): rows, moments, gradients and bookkeeping live in CPU memory (pinned
  when ``device`` is CUDA); ``device`` is the compute device. An owner gathers the requested rows on
  the CPU and moves them to ``device`` for the all-to-all (NCCL exchanges GPU tensors) and the model;
  gradients arriving at the owner move to the CPU for the optimizer step. Every mode works offloaded;
  ``deferred`` is the natural pairing (rows nobody reads cost nothing per step).

Fetch (collective: every rank calls it the same number of times, as the training loop does). Per
level: the unique ids of the micro-batch's non-generic sequences go to their owners (one
``all_to_all_single`` of split sizes, one of ids); owners answer with the rows (one
``all_to_all_single`` of rows), up to date as of the last completed step; the rows enter the graph
through an autograd function whose backward only *stores* the gradient of each unique row locally,
keyed by global id (no communication in backward, so gradient accumulation is free). Every rank takes
part in every level's exchange, even when all its sequences are generic (it still serves the others).

``reduce_gradients`` (accumulation boundary, collective): per level, the locally accumulated
``(id, grad)`` pairs are coalesced and sent to their owners (all-to-all); owners sum them over ranks
and micro-batches into their shard's (sparse: rows with an entry only) gradient and divide by the
world size (DeepSpeed averages the anchor's gradients over ranks, and :class:`MemoryBank` averages the
bank's; this keeps that mean).

``step(lr)``, no communication:

- ``mode="dense"`` (default): every owned row is updated exactly as ``torch.optim.AdamW``
  (single-tensor path) would update the whole table: decoupled weight decay, bias correction by the
  global step count, ``eps`` added to the bias-corrected root; rows no rank fetched have zero gradient,
  so they decay and follow their momentum. (``torch.optim.AdamW`` skips a table whose ``.grad`` is
  None; this bank never skips: a table no rank touched in a step is still stepped with zero gradient,
  as :class:`MemoryBank` does.)
- ``mode="deferred"``: the result of ``dense`` with no per-step work for rows that got no gradient.
  Each row records the last step it was brought up to date (``last_step``); the bank records the lr of
  every step since its oldest stale row (trimmed when every row is current). A stale row is
  *replayed*: for each skipped step ``s``, exactly the dense update with a zero gradient, op for op
  (``lr_s``, the bias corrections of step ``s``), vectorised over rows (per skipped step, one update
  of the rows still behind). Rows are caught up when read (:meth:`fetch` serves rows current as of the
  last completed step), when written (:meth:`step` catches the rows with a gradient up to step
  ``t - 1``, then applies step ``t`` with their gradient; the others stay behind), when saved
  (:meth:`state_dict`: every row, so saved rows are current), for :meth:`stats` with ``norms`` (the
  norms of the up-to-date bank, catching up every row: the trainer asks for them every ``log_every``
  steps), and by :meth:`catch_up`. The same ops as dense on row subsets: bit for bit equal to dense in
  tests/test_sharded_bank.py (fp32 on 2 and 3 ranks, bf16 on one); in general up to the last bit (a
  CPU kernel's vector and scalar paths, e.g. lerp's, may round differently). With a zero gradient the
  moments have a closed form (``m beta1^n``, ``v beta2^n``), and the row has one only when
  ``eps = 0``: then every skipped step adds a scalar times the fixed ratio ``m / sqrt(v)``, so ``n``
  steps collapse to ``a p - b m / sqrt(v)`` with scalars ``a``, ``b`` from the lrs and bias
  corrections. ``eps > 0`` inside the denominator breaks that, so no closed form is used (it would
  also round differently from dense): replay is exact for any ``eps``. Cost: the replay does the work
  dense would have done for those rows, but only when a row is read, written or saved (dense: every
  step); the win is with CPU offload and rows that are rarely read (a long-tailed cluster
  distribution), whose updates are batched into one catch-up instead of streaming the whole offloaded
  shard through the CPU every step. What remains per step is bookkeeping: the minimum of ``last_step``
  (one int64 per row) to trim the lr list. Memory: one int64 per row and one float per step since the
  oldest stale row.
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

Initialisation equals ``MemoryBank(layout, seed=s, dtype=...)`` row for row, bitwise: the same
per-level CPU generator (``seed * 1000 + level``; draws are copied to the device, so values do not
depend on it) drawn in the same order, but ``init_chunk_rows`` rows at a time, each rank keeping only
its rows (:meth:`MemoryLayout.init_rows` with ``row_ids``: a CPU generator's draws are sequential, so
chunked draws are the full draw). Memory: O(chunk + own rows), no full-table transient. Time: every
rank still draws the whole bank once, about 5 s (uniform parts) to 25 s (truncated-normal parts) per
billion drawn parameters on one core of this project's CPU test machine (zero parts are not drawn).
Draws always use a CPU generator, so a bank on a GPU gets the same values as on the CPU.

Checkpoints. :meth:`state_dict` catches every row up, then holds this rank's rows keyed by global row
id: per level ``ids``, ``rows`` (storage dtype), ``exp_avg`` / ``exp_avg_sq`` (fp32) and
``last_step`` (int64, every row at ``step`` since they are current); plus ``step``, ``mode``,
``hparams`` and the layout's shape. :meth:`load_state_dict` takes such states from fp32 or bf16
banks of any world size (rows cast to this bank's dtype) and :meth:`MemoryBank.state_dict`.
"""

from __future__ import annotations

from typing import Optional

import torch

from memtrain.model.hierarchical import FetchedMemory, MemoryLayout
from memtrain.parallel.bank import fetch_inputs, per_sequence_rows

_ID_DTYPE = torch.int64
STORAGE_DTYPES = (torch.float32, torch.bfloat16)
_INIT_CHUNK_ELEMENTS = 1 << 24  # default init chunk: rows of about 16M parameters (64 MiB of fp32 draws)
_REPLAY_CHUNK_ELEMENTS = 1 << 24  # catch-up gathers at most this many parameters of rows at once


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

    MODES = ("dense", "deferred", "lazy")

    def __init__(self, layout: MemoryLayout, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 seed: int = 0, mode: str = "dense", group=None, subtree_ranks: Optional[list[list[int]]] = None,
                 compute_dtype: Optional[torch.dtype] = None, offload: bool = False,
                 init_chunk_rows: Optional[int] = None):
        """``dtype``: the rows' storage dtype, float32 or bfloat16 (AdamW moments and gradients are always
        fp32). ``compute_dtype``: the dtype of the rows :meth:`fetch` returns, cast after communication
        (default: ``dtype``). ``offload``: rows, moments and bookkeeping in CPU memory (pinned when
        ``device`` is CUDA), ``device`` being the compute device (exchanges, fetched rows).
        ``init_chunk_rows``: rows drawn at once at initialisation (default: about 2^24 parameters).

        ``subtree_ranks[s]``: the ranks that read level-1 subtree ``s`` (cluster-affine placement,
        :func:`memtrain.data.loader.affine_groups`; every subtree the same number of ranks). Then a row
        of any level is owned by one of the ranks of its level-1 ancestor, so its traffic never leaves
        that group; None: round robin over all ranks."""
        if mode not in self.MODES:
            raise ValueError(f"sharded bank mode must be one of {self.MODES}, got {mode!r}")
        if dtype not in STORAGE_DTYPES:
            raise ValueError(f"the sharded bank stores rows in torch.float32 or torch.bfloat16 (AdamW moments "
                             f"always fp32), got {dtype}")
        if compute_dtype is not None and not compute_dtype.is_floating_point:
            raise ValueError(f"compute_dtype must be a floating-point dtype, got {compute_dtype}")
        self.layout = layout
        self.device = torch.device(device)
        self.dtype = dtype
        self.compute_dtype = compute_dtype if compute_dtype is not None else dtype
        self.offload = offload
        self.store_device = torch.device("cpu") if offload else self.device  # rows, moments, bookkeeping
        self._pin = offload and self.device.type == "cuda"
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
        self.owned: list[Optional[torch.Tensor]] = []  # sorted global ids of this rank's rows (store device)
        self.shards: list[Optional[torch.Tensor]] = []  # [n_owned, s_l] in the storage dtype
        self.last_step: list[Optional[torch.Tensor]] = []  # [n_owned] int64: step each row is current at
        for level in range(layout.depth):
            if layout.levels[level] == 0:
                self.owned.append(None)
                self.shards.append(None)
                self.last_step.append(None)
                continue
            n, width = layout.rows(level), layout.block_size(level)
            all_ids = torch.arange(n, dtype=_ID_DTYPE, device=self.device)
            mine = all_ids[self.owner(level, all_ids) == self.rank].to(self.store_device)
            shard = self._alloc((len(mine), width), dtype, zero=False)
            # MemoryBank's generator and draws, in row chunks, keeping this rank's rows (module docstring).
            gen = torch.Generator().manual_seed(seed * 1000 + level)
            chunk = init_chunk_rows or max(1, _INIT_CHUNK_ELEMENTS // width)
            layout.init_rows(shard, level, gen, row_ids=mine, n_rows=n, chunk_rows=chunk)
            self.owned.append(mine)
            self.shards.append(shard)
            self.last_step.append(torch.zeros(len(mine), dtype=_ID_DTYPE, device=self.store_device))
        # Per level: (sorted local positions of the rows with a gradient entry, their fp32 gradients).
        self.grads: list[Optional[tuple[torch.Tensor, torch.Tensor]]] = [None] * layout.depth
        self.exp_avg: list[Optional[torch.Tensor]] = [None] * layout.depth
        self.exp_avg_sq: list[Optional[torch.Tensor]] = [None] * layout.depth
        self._step = 0
        self._lrs: list[float] = []  # deferred: lr of steps _lr_first, _lr_first + 1, ..., _step
        self._lr_first = 1
        self.hparams: Optional[dict] = None
        self._token = torch.zeros((), requires_grad=True)  # makes fetched rows part of the graph
        self._pending: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(layout.depth)]
        self._reduced = False
        self._bytes = [0, 0]  # sent, received since the last step
        self._micro = 0  # counted fetches since the last step
        self._last = {"sent": 0, "received": 0, "micro_batches": 0}
        self._reset_counters()

    def _alloc(self, shape: tuple[int, ...], dtype: torch.dtype, zero: bool = True) -> torch.Tensor:
        """A tensor in the store (CPU and pinned when offloading to a CUDA device)."""
        make = torch.zeros if zero else torch.empty
        if self._pin:
            return make(shape, dtype=dtype, device="cpu", pin_memory=True)
        return make(shape, dtype=dtype, device=self.store_device)

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

    def _serve(self, level: int, uniq: torch.Tensor, order: torch.Tensor, splits: list[int],
               recv_splits: list[int], count: bool) -> torch.Tensor:
        """Rows ``uniq`` of ``level`` from their owners (collective; ``order`` and ``splits`` from
        :meth:`_route`, ``recv_splits`` exchanged): the requests go out, this rank serves what it owns
        (deferred rows caught up first), the rows come back in the storage dtype, in ``uniq``'s order."""
        requests = self._exchange(uniq[order], splits, recv_splits, count)
        local = self._local_index(level, requests)
        if count and local.numel():
            self._touched[level][local] = True
        if self.mode == "deferred" and local.numel():
            with torch.no_grad():
                self._catch_up_rows(level, torch.unique(local), self._step)
        served = self.shards[level].index_select(0, local).to(self.device)  # storage dtype on the wire
        got = self._exchange(served, recv_splits, splits, count)  # rows in `order` order
        rows = torch.empty_like(got)
        rows[order] = got
        return rows

    def _local_index(self, level: int, rows: torch.Tensor) -> torch.Tensor:
        """Global ids owned by this rank -> positions in this rank's shard (store device)."""
        return torch.searchsorted(self.owned[level], rows.to(self.store_device))

    # -- parameters and optimizer ------------------------------------------------------------------

    def parameters(self) -> list[torch.Tensor]:
        """This rank's shards (not ``nn.Parameter``s; gradients live in :attr:`grads`, sparse: per level
        the sorted local positions of the rows with a gradient entry and their fp32 gradients)."""
        return [s for s in self.shards if s is not None]

    def numel(self) -> int:
        """Parameters of the whole bank (all ranks), as :meth:`MemoryBank.numel`."""
        return sum(self.layout.rows(l) * self.layout.block_size(l) for l in range(self.layout.depth)
                   if self.shards[l] is not None)

    def build_optimizer(self, lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
        if self.mode == "lazy" and weight_decay != 0:
            raise ValueError("the lazy sharded bank follows torch.optim.SparseAdam, which has no weight decay; "
                             f"got weight_decay={weight_decay} (use mode='dense' or 'deferred', or weight_decay 0)")
        self.hparams = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        for l, s in enumerate(self.shards):
            if s is not None and self.exp_avg[l] is None:
                self.exp_avg[l] = self._alloc(s.shape, torch.float32)
                self.exp_avg_sq[l] = self._alloc(s.shape, torch.float32)

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
        """As :meth:`MemoryBank.fetch`; collective over the data-parallel group (module docstring). Rows
        are served up to date as of the last completed step, and returned in ``compute_dtype``.

        Bad ids raise ValueError on the rank that has them *and* on every other rank (the error travels
        with the split sizes of the first exchange, so no rank is left waiting in a collective)."""
        ids, used, error = fetch_inputs(self.layout, ids, generic, self.device)
        B = ids.shape[0]
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
            rows = self._serve(level, uniq, order, splits, recv_splits, count)
            if not bool(used.any()):
                levels.append(None)
                continue
            # One row per sequence in fp32, then the cast: the gradient of a row several sequences share is
            # summed over them in fp32, as the replicated bank's (summed in bf16 until 2026-11-30: 1.7e-3 off).
            rows = _FetchedRows.apply(rows.to(torch.float32), self._token, self, level, uniq)
            levels.append(per_sequence_rows(rows, inverse, used).to(self.compute_dtype))
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
            got = self._exchange(grads[order], splits, recv_splits, True).to(self.store_device)
            local = self._local_index(level, got_ids)
            if self.world > 1:
                got = got / self.world
            if self.grads[level] is not None:  # a second reduction in the same step adds to the first
                local = torch.cat([self.grads[level][0], local])
                got = torch.cat([self.grads[level][1], got])
            rows, where = torch.unique(local, return_inverse=True)
            summed = torch.zeros(len(rows), shard.shape[1], dtype=torch.float32, device=self.store_device)
            summed.index_add_(0, where, got)  # in arrival order, as into a dense zero gradient
            self.grads[level] = (rows, summed)
        self._reduced = True

    def _sq_norms(self) -> list[float]:
        return [float(g[1].double().square().sum()) if g is not None else 0.0 for g in self.grads]

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
                g[1].mul_(coef)

    # -- optimizer step ----------------------------------------------------------------------------

    def _adamw(self, p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, lr: float,
               step: int) -> None:
        """torch.optim.AdamW's single-tensor update of rows ``p`` (in place; any subset or view), op for
        op, in fp32: bf16 rows are upcast, updated and rounded back."""
        beta1, beta2 = self.hparams["betas"]
        eps, wd = self.hparams["eps"], self.hparams["weight_decay"]
        bias_correction1 = 1 - beta1 ** step
        bias_correction2 = 1 - beta2 ** step
        w = p if p.dtype == torch.float32 else p.float()
        if wd != 0:
            w.mul_(1 - lr * wd)
        m.lerp_(grad, 1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (v.sqrt() / bias_correction2 ** 0.5).add_(eps)
        w.addcdiv_(m, denom, value=-(lr / bias_correction1))
        if w is not p:
            p.copy_(w)

    def _lr_of(self, step: int) -> float:
        return self._lrs[step - self._lr_first]

    def _catch_up_rows(self, level: int, rows: torch.Tensor, target: int) -> None:
        """Deferred mode: replay the zero-gradient dense steps up to ``target`` for the local ``rows``
        (unique positions) that are behind. Rows are sorted by ``last_step``, so at each skipped step
        the rows still behind are a prefix: one update per step on that prefix."""
        if self.mode != "deferred" or rows.numel() == 0:
            return
        last = self.last_step[level].index_select(0, rows)
        behind = last < target
        if not bool(behind.any()):
            return
        last, order = torch.sort(last[behind], stable=True)
        rows = rows[behind][order]
        p, m, v = self.shards[level], self.exp_avg[level], self.exp_avg_sq[level]
        chunk = max(1, _REPLAY_CHUNK_ELEMENTS // p.shape[1])
        for a in range(0, len(rows), chunk):
            r, ls = rows[a:a + chunk], last[a:a + chunk]
            P, M, V = p.index_select(0, r), m.index_select(0, r), v.index_select(0, r)
            zero = torch.zeros_like(M)
            first = int(ls[0])
            steps = torch.arange(first + 1, target + 1, dtype=ls.dtype, device=ls.device)
            for s, c in zip(range(first + 1, target + 1), torch.searchsorted(ls, steps).tolist()):
                self._adamw(P[:c], M[:c], V[:c], zero[:c], self._lr_of(s), s)  # c: rows with last < s
            p.index_copy_(0, r, P)
            m.index_copy_(0, r, M)
            v.index_copy_(0, r, V)
            self.last_step[level].index_fill_(0, r, target)

    def _trim_lrs(self) -> None:
        """Forget the lrs of steps every row has been brought past."""
        oldest = min((int(t.min()) for t in self.last_step if t is not None and t.numel()), default=self._step)
        drop = oldest + 1 - self._lr_first
        if drop > 0:
            del self._lrs[:drop]
            self._lr_first = oldest + 1

    def catch_up(self) -> None:
        """Bring every row of this rank up to date (deferred mode; a no-op in the others). Local: no
        communication."""
        if self.mode != "deferred":
            return
        with torch.no_grad():
            for l, s in enumerate(self.shards):
                if s is not None:
                    self._catch_up_rows(l, torch.arange(s.shape[0], device=self.store_device), self._step)
        self._trim_lrs()

    def step(self, lr: float) -> None:
        """One optimizer step at ``lr`` on this rank's rows (no communication unless gradients were not
        reduced yet), then clear the gradients and close the byte-count window."""
        if self.hparams is None:
            raise RuntimeError("call build_optimizer() before step()")
        if not self._reduced:
            self.reduce_gradients()
        beta1, beta2 = self.hparams["betas"]
        eps = self.hparams["eps"]
        self._step += 1
        step = self._step
        if self.mode == "deferred":
            self._lrs.append(lr)
        bias_correction1 = 1 - beta1 ** step
        bias_correction2 = 1 - beta2 ** step
        with torch.no_grad():
            for l, p in enumerate(self.shards):
                if p is None:
                    continue
                m, v = self.exp_avg[l], self.exp_avg_sq[l]
                rows, g = self.grads[l] if self.grads[l] is not None else (None, None)
                has_grad = rows is not None and rows.numel() > 0
                if self.mode == "dense":  # torch.optim.AdamW, single-tensor path, op for op
                    grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
                    if has_grad:
                        grad.index_copy_(0, rows, g)
                    self._adamw(p, m, v, grad, lr, step)
                    self.last_step[l].fill_(step)
                elif self.mode == "deferred":  # the dense update, on the rows with a gradient only
                    if not has_grad:
                        continue
                    self._catch_up_rows(l, rows, step - 1)
                    P, M, V = p.index_select(0, rows), m.index_select(0, rows), v.index_select(0, rows)
                    self._adamw(P, M, V, g, lr, step)
                    p.index_copy_(0, rows, P)
                    m.index_copy_(0, rows, M)
                    v.index_copy_(0, rows, V)
                    self.last_step[l].index_fill_(0, rows, step)
                else:  # torch.optim.SparseAdam on the rows with a gradient entry, op for op
                    self.last_step[l].fill_(step)
                    if not has_grad:
                        continue
                    old_m, old_v = m.index_select(0, rows), v.index_select(0, rows)
                    m_upd = g.sub(old_m).mul_(1 - beta1)
                    m.index_add_(0, rows, m_upd)
                    v_upd = g.pow(2).sub_(old_v).mul_(1 - beta2)
                    v.index_add_(0, rows, v_upd)
                    numer = m_upd.add_(old_m)
                    v_upd.add_(old_v)
                    denom = v_upd.sqrt_().add_(eps)
                    step_size = lr * bias_correction2 ** 0.5 / bias_correction1
                    update = -step_size * numer.div_(denom)
                    if p.dtype == torch.float32:
                        p.index_add_(0, rows, update)
                    else:  # rows are unique: the same sum on the upcast rows, then rounded
                        p.index_copy_(0, rows, p.index_select(0, rows).float().add_(update).to(p.dtype))
        if self.mode == "deferred":
            self._trim_lrs()
        self._end_step()

    def skip_step(self) -> None:
        """Drop this step's gradients without an update (a step the divergence guard skips): rows,
        moments and the step count stay as they were; the traffic is still counted."""
        self._pending = [[] for _ in self._pending]
        self._end_step()

    def _end_step(self) -> None:
        self.grads = [None] * self.layout.depth
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
        for backward (in the bank's storage dtype, ``e`` bytes per element: 4 fp32, 2 bf16), and a
        reduce-scatter of its fp32 gradient, each moving ``(W - 1) / W`` of the bank per rank (ring
        algorithms)::

            m * (W - 1) / W * P * (2 e + 4),   P = sum_l k^l s_l (bank parameters), W = world size,

        ``m`` = micro-batches per step (default: the counted fetches of the last step, at least 1).
        For fp32 storage that is ``3 m (W - 1) / W P 4``.
        """
        m = micro_batches if micro_batches is not None else max(self._last["micro_batches"], 1)
        P = sum(self.layout.rows(l) * self.layout.block_size(l) for l in range(self.layout.depth)
                if self.shards[l] is not None)
        e = torch.empty((), dtype=self.dtype).element_size()
        return m * (self.world - 1) * P * (2 * e + 4) // self.world

    def _reset_counters(self) -> None:
        self._touched = [torch.zeros(s.shape[0] if s is not None else 0, dtype=torch.bool, device=self.store_device)
                         for s in self.shards]
        self._counts = torch.zeros(2, dtype=torch.float64)  # sequences, generic sequences

    def stats(self, norms: bool = True, reset: bool = True) -> dict[str, float]:
        """:meth:`MemoryBank.stats`'s keys (over all ranks: one all-reduce; collective) plus this rank's
        ``comm/bank_bytes_sent`` / ``comm/bank_bytes_received`` of the last step and
        ``comm/bank_zero3_bytes`` (:meth:`zero3_reference_bytes`). With ``norms``, the norms of the
        up-to-date bank: deferred mode catches every row up first (:meth:`catch_up`)."""
        if norms:
            self.catch_up()
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
        """This rank's rows keyed by global row id, every row caught up first (deferred mode): per level
        ``ids`` (global), ``rows`` (storage dtype), ``exp_avg``, ``exp_avg_sq`` (fp32) and ``last_step``
        (int64, all ``step``); plus ``step``, ``mode``, ``hparams`` and the layout's shape."""
        self.catch_up()
        levels = {}
        for l, s in enumerate(self.shards):
            if s is None:
                continue
            levels[str(l)] = {"ids": self.owned[l].cpu().clone(), "rows": s.cpu().clone(),
                              "exp_avg": self.exp_avg[l].cpu().clone() if self.exp_avg[l] is not None else None,
                              "exp_avg_sq": self.exp_avg_sq[l].cpu().clone() if self.exp_avg_sq[l] is not None
                              else None,
                              "last_step": self.last_step[l].cpu().clone()}
        return {"format": "sharded_bank/v1", "levels_state": levels, "step": self._step, "mode": self.mode,
                "hparams": self.hparams, **self._meta()}

    def load_state_dict(self, state: dict) -> None:
        """Load from any state whose per-level ``ids`` cover this rank's rows (this rank's own state, or
        :meth:`gather_full_state` saved under any world size: resharding; fp32 or bf16 rows, cast to this
        bank's dtype), or from a :meth:`MemoryBank.state_dict` (rows, AdamW moments and step). Loaded
        rows are current (``last_step`` = ``step``); a state with rows behind its step is rejected."""
        want = (list(self.layout.levels), self.layout.branching)
        got = (list(state.get("levels", [])), state.get("branching"))
        if want != got:
            raise ValueError(f"bank was saved with levels {got[0]} and branching {got[1]}; this bank has "
                             f"levels {want[0]} and branching {want[1]}")
        if "levels_state" not in state:
            state = self._from_memory_bank_state(state)
        step = int(state.get("step", 0))
        for l, s in enumerate(self.shards):
            if s is None:
                continue
            entry = state["levels_state"][str(l)]
            last = entry.get("last_step")
            if last is not None and bool((last != step).any()):
                raise ValueError(f"level-{l + 1} state has rows not caught up to step {step} (a deferred bank's "
                                 "state_dict() catches every row up; save with it)")
            ids = entry["ids"].cpu()
            owned = self.owned[l].cpu()
            order = torch.argsort(ids)
            sorted_ids = ids[order]
            pos = torch.searchsorted(sorted_ids, owned).clamp_max(max(len(ids) - 1, 0))
            if len(owned) == 0:  # this rank owns no row of the level (more ranks than rows, or affine)
                self.last_step[l].fill_(step)
                continue
            if len(ids) == 0 or not torch.equal(sorted_ids[pos], owned):
                raise ValueError(f"level-{l + 1} state lacks rows owned by rank {self.rank}")
            take = order[pos]
            s.copy_(entry["rows"].cpu().index_select(0, take))  # cast to the storage dtype
            if entry.get("exp_avg") is not None:
                for name, mine in (("exp_avg", self.exp_avg), ("exp_avg_sq", self.exp_avg_sq)):
                    if mine[l] is None:
                        mine[l] = self._alloc(s.shape, torch.float32)
                    mine[l].copy_(entry[name].cpu().index_select(0, take))
            self.last_step[l].fill_(step)
        self._step = step
        self._lrs, self._lr_first = [], step + 1
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
        for name in ("rows", "exp_avg", "exp_avg_sq", "last_step"):
            vals = [p["levels_state"][key].get(name) for p in parts]
            entry[name] = torch.cat(vals)[order] if all(v is not None for v in vals) else None
        levels[key] = entry
        tables[key], exp_avg[key], exp_avg_sq[key] = entry["rows"], entry["exp_avg"], entry["exp_avg_sq"]
    return {**first, "levels_state": levels, "tables": tables, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


__all__ = ["STORAGE_DTYPES", "ShardedMemoryBank", "merge_states"]
