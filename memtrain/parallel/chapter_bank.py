"""The sharded cross-attention bank: latent-token banks whose chapters are rows of a row-sharded bank.

A cross-attention memory bank (:class:`memtrain.model.crossattn.LatentBank`, ``N_m x width``, in ``C``
chapters of ``N_c = N_m / C`` tokens) is read by chapters: a routed memory layer (``top_k > 0``) picks
its chapters *inside* the forward (its router looks at the layer's input) and projects the keys and
values of the unique routed chapters only (``bank.chapters(ids, dtype)``). With ``memory.crossattn.bank:
sharded`` the trainer replaces every ``LatentBank`` of the model by a :class:`ChapterBankView` of one
:class:`ShardedChapterBank`, before DeepSpeed wraps the model (the views hold no parameters or buffers,
so ZeRO never gathers, partitions or checkpoints the bank), the same principle as the hierarchical
bank (../shared/DESIGN.md, "The sharded memory bank").

Ownership. :class:`ShardedChapterBank` *is* a :class:`~memtrain.parallel.sharded_bank.ShardedMemoryBank`
whose "levels" are the model's banks (one shared bank, or one per memory layer) and whose rows are
chapters: row ``c`` of level ``i`` is chapter ``c`` of bank ``i``, ``N_c x width`` numbers flattened
(:class:`ChapterLayout`). Chapter ``c`` lives on rank ``c % W`` (round robin: the inherited
:meth:`~ShardedMemoryBank.owner`); each rank keeps its chapters, their fp32 gradient and AdamW moments.
The initial rows are copied from the model's ``LatentBank`` s (built identically on every rank from the
run's seed, so a sharded run starts from the replicated run's bank bit for bit); the full banks are
dropped once copied (before ``model.to(device)``: the whole bank never reaches the GPU).

Fetch inside the forward (:meth:`ShardedChapterBank.fetch_chapters`, collective). ``view.chapters(ids)``
takes the unique ids, sends them to their owners (``all_to_all_single`` of split sizes, then of ids),
owners answer with the chapters (one ``all_to_all_single`` of rows, storage dtype), and the rows enter
the graph through the sharded bank's autograd function, whose backward only stores each unique
chapter's fp32 gradient locally (no communication in backward; gradient accumulation is free). Every
memory layer reads its bank exactly once per forward (routed: the unique chapters of the micro-batch;
unrouted: every chapter), and every rank runs the same layers, so every rank makes the same number of
fetches per forward, including validation forwards (every rank evaluates the same number of
micro-batches, :class:`memtrain.data.loader.ValidationSet`) and ranks whose micro-batch routes to no
chapter of another rank (they still serve the others). Bad ids raise ValueError on every rank (the
error travels with the split sizes). A world of one (or no process group) exchanges nothing. Fetches
of modules in training mode are counted (``comm/bank_bytes_*``); evaluation fetches (``model.eval()``)
are not. With activation checkpointing the recomputation in backward fetches again (every rank
recomputes the same layers in the same order, so the collectives still match; the traffic of the
fetch doubles and is counted).

Gradient path and optimizer (inherited, unchanged). At the accumulation boundary
:meth:`~ShardedMemoryBank.reduce_gradients` sends every accumulated ``(chapter, gradient)`` pair to its
owner (all-to-all), owners sum over ranks and micro-batches and divide by the world size (DeepSpeed's
mean over ranks, as the replicated bank's gradient gets). ``grad_norm`` / ``scale_gradients`` serve
clipping; ``step(lr)`` in the default ``dense`` mode is ``torch.optim.AdamW`` (single tensor path) over
the whole bank, op for op: every chapter decays and follows its momentum each step, fetched or not, so
a sharded run equals the replicated run whose ``LatentBank.weight`` DeepSpeed steps with torch AdamW
(fp32 storage; bf16 storage updates in fp32 and rounds, as the hierarchical bank). The learning rate is
the ``bank`` role's (:func:`memtrain.parallel.engine.lr_at` ``(recipe, "bank")``: ``bank_lr``, the
warmup/cosine, 0 from ``freeze_bank_at``); a bank frozen from the start (``freeze_bank``) is never
stepped. Only dense ``LatentBank`` s shard: a low-rank bank (``A B^T``, ``B`` shared by all chapters)
and an int8 bank (frozen, quantised) are refused.

Unrouted banks (``top_k 0``) shard too: every memory layer then fetches every chapter every forward,
which moves as much as ZeRO-3's all-gather of the bank (sharding saves the bank's and its optimizer's
memory, not traffic; the counters show it).

Checkpoints (inherited): ``state_dict`` keyed by global row, written by
:func:`memtrain.parallel.bank_checkpoint.save_bank` as a DCP folder ``memory_bank/`` (level ``i`` =
bank ``i``, ``[C, N_c width]`` tables) that reshards to any world size on load. The view modules add
nothing to the model's state dict, so DeepSpeed's files hold no bank; :func:`latent_bank_state` turns
the folder back into ``LatentBank`` weights (evaluation with the replicated model).

Bytes (``comm/bank_bytes_sent`` / ``_received``, this rank, last step; self-sends excluded) follow
:func:`predict_chapter_bytes` exactly; ``comm/bank_zero3_bytes`` is what ZeRO-3 would move for the same
bank as a dense parameter (:meth:`ShardedChapterBank.zero3_reference_bytes`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import nn

from memtrain.errors import LaunchError
from memtrain.parallel.sharded_bank import ShardedMemoryBank, _FetchedRows

ID_BYTES = 8  # int64 ids and split sizes on the wire


class ChapterLayout:
    """The row-table shape :class:`ShardedMemoryBank` reads from a ``MemoryLayout``, for chapter banks:
    level ``i`` is bank ``i`` with ``chapters`` rows of ``chapter_tokens x width`` numbers.

    :meth:`init_rows` copies the rows from ``sources`` (the banks' ``[tokens, width]`` weights) when
    given, else draws ``N(0, init_std^2)`` from the bank's generator in row chunks (the same values for
    any world size and chunk: a CPU generator's draws are sequential)."""

    def __init__(self, n_banks: int, chapters: int, chapter_tokens: int, width: int, init_std: float = 1.0,
                 sources: Optional[Sequence[torch.Tensor]] = None):
        if sources is not None and len(sources) != n_banks:
            raise ValueError(f"{len(sources)} source banks for {n_banks} banks")
        self.n_banks, self.chapters, self.chapter_tokens, self.width = n_banks, chapters, chapter_tokens, width
        self.init_std = init_std
        self.sources = list(sources) if sources is not None else None
        self.levels = [1] * n_banks  # every "level" (bank) is active
        self.branching = chapters  # recorded in checkpoints (bank.json); placement is round robin

    @property
    def depth(self) -> int:
        return self.n_banks

    @property
    def active_levels(self) -> list[int]:
        return list(range(self.n_banks))

    def rows(self, level: int) -> int:
        return self.chapters

    def block_size(self, level: int) -> int:
        return self.chapter_tokens * self.width

    @property
    def bank_parameters(self) -> int:
        return self.n_banks * self.chapters * self.block_size(0)

    def init_rows(self, rows: torch.Tensor, level: int, generator: Optional[torch.Generator] = None, *,
                  row_ids: torch.Tensor, n_rows: int, chunk_rows: Optional[int] = None) -> None:
        if rows.numel() == 0:
            return
        ids = row_ids.to("cpu")
        step = max(1, chunk_rows or n_rows)
        with torch.no_grad():
            if self.sources is not None:
                table = self.sources[level].detach().reshape(self.chapters, -1)
                for a in range(0, len(ids), step):
                    rows[a:a + step].copy_(table.index_select(0, ids[a:a + step].to(table.device)))
                return
            for start in range(0, n_rows, step):
                stop = min(start + step, n_rows)
                drawn = torch.randn(stop - start, self.block_size(level), generator=generator) * self.init_std
                lo, hi = torch.searchsorted(ids, torch.tensor([start, stop])).tolist()
                if hi > lo:
                    rows[lo:hi].copy_(drawn.index_select(0, ids[lo:hi] - start))


class ShardedChapterBank(ShardedMemoryBank):
    """``n_banks`` banks of ``tokens x width`` in ``chapters`` chapters, sharded by chapter over the
    data-parallel ranks (module docstring). ``views[i]`` is bank ``i``'s reading interface for the model.

    ``sources``: the banks' initial ``[tokens, width]`` values (the model's ``LatentBank`` weights;
    every rank passes the same), else drawn from ``seed``. ``reads_per_forward``: memory-layer reads of
    the banks per forward (the number of memory layers), to turn counted fetches into micro-batches for
    :meth:`zero3_reference_bytes`. Other arguments as :class:`ShardedMemoryBank` (storage ``dtype``
    float32 or bfloat16; ``mode`` dense, deferred or lazy; ``group``; ``offload``)."""

    def __init__(self, n_banks: int, tokens: int, width: int, chapters: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, seed: int = 0, mode: str = "dense", group=None,
                 sources: Optional[Sequence[torch.Tensor]] = None, init_std: float = 1.0,
                 reads_per_forward: int = 1, offload: bool = False, init_chunk_rows: Optional[int] = None):
        if tokens % chapters:
            raise ValueError(f"{tokens} tokens do not split into {chapters} equal chapters")
        layout = ChapterLayout(n_banks, chapters, tokens // chapters, width, init_std, sources)
        super().__init__(layout, device, dtype=dtype, seed=seed, mode=mode, group=group, offload=offload,
                         init_chunk_rows=init_chunk_rows)
        layout.sources = None  # the full banks are no longer referenced here
        self.tokens, self.width, self.chapters = tokens, width, chapters
        self.reads_per_forward = max(1, int(reads_per_forward))
        self.frozen = False
        self.trace: Optional[list[tuple[int, torch.Tensor]]] = None  # tests/benchmarks: counted fetches' ids
        self.views = [ChapterBankView(self, i) for i in range(n_banks)]

    # -- building from a model ---------------------------------------------------------------------

    @classmethod
    def replace_banks(cls, crossattn: nn.Module, device: torch.device | str = "cpu", mode: str = "dense",
                      group=None, dtype: Optional[torch.dtype] = None) -> "ShardedChapterBank":
        """Shard the banks of ``crossattn`` (a :class:`memtrain.model.crossattn.CrossAttnMemory`): a bank
        built from their current values (storage dtype: theirs, unless ``dtype``), whose views replace
        them in ``crossattn.banks``. Call on every rank, before DeepSpeed wraps the model (and, to keep
        the full banks off the GPU, before ``model.to(device)``). A bank whose parameters do not require
        gradients (``freeze_bank``) makes the sharded bank frozen (never stepped)."""
        banks = list(crossattn.banks)
        kinds = {b.kind for b in banks}
        if kinds != {"dense"}:
            raise LaunchError(f"a sharded cross-attention bank stores whole chapters as rows; this model's banks are "
                              f"{sorted(kinds)} (low-rank or int8). Set memory.crossattn.bank: replicated")
        first = banks[0]
        bank = cls(len(banks), first.tokens, first.width, first.n_chapters, device=device,
                   dtype=dtype or first.weight.dtype, mode=mode, group=group,
                   sources=[b.weight.detach() for b in banks], init_std=first.init_std,
                   reads_per_forward=len(getattr(crossattn, "parts", ())) or 1)
        if not any(p.requires_grad for b in banks for p in b.parameters()):
            bank.requires_grad_(False)
        for i, view in enumerate(bank.views):
            crossattn.banks[i] = view
        return bank

    def requires_grad_(self, flag: bool) -> "ShardedChapterBank":
        """False: fetched chapters carry no gradient and :meth:`step` leaves the bank as it is."""
        super().requires_grad_(flag)
        self.frozen = not flag
        return self

    def describe(self) -> str:
        """One line for the training log."""
        n = self.layout.bank_parameters
        return (f"sharded cross-attention bank: {self.layout.n_banks} bank(s) x {self.chapters} chapters of "
                f"{self.layout.chapter_tokens} tokens x {self.width} ({n:,} parameters, "
                f"{n * torch.empty((), dtype=self.dtype).element_size() / 2**30:.2f} GiB) over {self.world} rank(s), "
                f"{sum(len(o) for o in self.owned)} chapter rows here ({self.mode} AdamW"
                + (", frozen" if self.frozen else "") + ")")

    # -- fetch (collective) ------------------------------------------------------------------------

    def fetch_chapters(self, level: int, uniq: torch.Tensor, dtype: Optional[torch.dtype] = None,
                       count: bool = True) -> torch.Tensor:
        """Chapters ``uniq`` (unique ids, ``[U]``) of bank ``level`` from their owners as a differentiable
        ``[U, chapter_tokens * width]`` tensor in ``dtype`` (default: the storage dtype; cast after
        communication). Collective over the group: every rank calls it for the same banks in the same
        order. ``count``: include the traffic in this step's bytes (training forwards)."""
        uniq = uniq.reshape(-1).to(device=self.device, dtype=torch.int64)
        n = self.chapters
        bad = uniq.numel() > 0 and (int(uniq.min()) < 0 or int(uniq.max()) >= n)
        if bad:
            splits, order = [-1] * self.world, None
        else:
            order, splits = self._route(level, uniq)
        recv_splits = self._exchange_splits(splits, count)
        if bad:
            raise ValueError(f"chapter ids of bank {level} must lie in [0, {n}); got [{int(uniq.min())}, "
                             f"{int(uniq.max())}]")
        if any(s < 0 for s in recv_splits):
            raise ValueError("another data-parallel rank passed chapter ids out of range to the cross-attention bank")
        if count:
            self._micro += 1
            if self.trace is not None:
                self.trace.append((level, uniq.cpu()))
        rows = self._serve(level, uniq, order, splits, recv_splits, count)
        if dtype is not None:
            rows = rows.to(dtype)
        return _FetchedRows.apply(rows, self._token, self, level, uniq)

    # -- after backward ----------------------------------------------------------------------------

    def step(self, lr: float) -> None:
        """:meth:`ShardedMemoryBank.step` (AdamW on this rank's chapters); a frozen bank only closes the
        step (gradients dropped, bytes counted)."""
        if self.frozen:
            self.skip_step()
            return
        super().step(lr)

    # -- counters ----------------------------------------------------------------------------------

    def zero3_reference_bytes(self, micro_batches: Optional[int] = None) -> int:
        """Bytes one rank would send (and receive) per step if the banks were ordinary ZeRO-3 parameters:
        per micro-batch an all-gather of every bank for forward and one for backward (storage dtype, ``e``
        bytes) and a reduce-scatter of their fp32 gradient, each ``(W - 1) / W`` of the banks:
        ``m (W - 1) / W P (2 e + 4)``, ``P`` = every bank's ``tokens x width``. A lower bound: ZeRO-3 gathers
        a parameter per use, so a shared bank read by several layers is gathered once per reading layer.
        ``m`` = micro-batches of the last step (counted fetches / ``reads_per_forward``), at least 1."""
        m = micro_batches if micro_batches is not None else max(self._last["micro_batches"] // self.reads_per_forward, 1)
        e = torch.empty((), dtype=self.dtype).element_size()
        return m * (self.world - 1) * self.layout.bank_parameters * (2 * e + 4) // self.world

    def stats(self, norms: bool = True, reset: bool = True) -> dict[str, float]:
        """Over all ranks (one all-reduce; collective): ``memory_module/bank_chapters_fetched_frac`` (chapters
        of every bank fetched by some rank in a counted forward since the last reset, over all chapters),
        with ``norms`` ``memory_module/bank_param_norm`` (all banks, up to date); this rank's
        ``comm/bank_bytes_sent`` / ``comm/bank_bytes_received`` of the last step and ``comm/bank_zero3_bytes``."""
        if norms:
            self.catch_up()
        n = self.layout.depth
        local = [float(self._touched[l].sum()) for l in range(n)]
        if norms:
            local += [float(self.shards[l].double().square().sum()) for l in range(n)]
        total = self._all_reduce(local)
        out = {"memory_module/bank_chapters_fetched_frac": sum(total[:n]) / (n * self.chapters)}
        if norms:
            out["memory_module/bank_param_norm"] = sum(total[n:]) ** 0.5
        out["comm/bank_bytes_sent"] = float(self._last["sent"])
        out["comm/bank_bytes_received"] = float(self._last["received"])
        out["comm/bank_zero3_bytes"] = float(self.zero3_reference_bytes())
        if reset:
            self._reset_counters()
        return out


class ChapterBankView(nn.Module):
    """Bank ``index`` of a :class:`ShardedChapterBank`, answering :class:`memtrain.model.crossattn.LatentBank`'s
    reading interface (``rows``, ``chapters``, ``all``, ``tokens``, ``width``, ``n_chapters``,
    ``chapter_tokens``, ``parameter_count``, ``kind``) by collective fetches. No parameters, no buffers,
    no state-dict entries. Fetches are counted while the module is in training mode."""

    def __init__(self, bank: ShardedChapterBank, index: int):
        super().__init__()
        self.sharded = bank  # not a module: model.to(), DeepSpeed and state_dict() leave it alone
        self.index = index
        self.tokens, self.width, self.n_chapters = bank.tokens, bank.width, bank.chapters
        self.chapter_tokens = bank.layout.chapter_tokens
        self.rank = None  # LatentBank's low rank (none: dense rows)
        self.kind = "sharded"
        self.init_std = bank.layout.init_std

    def _fetch(self, uniq: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
        return self.sharded.fetch_chapters(self.index, uniq, dtype, count=self.training)

    def chapters(self, ids: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Whole chapters ``ids`` (any shape) as ``[*ids.shape, chapter_tokens, width]`` (collective)."""
        flat = ids.reshape(-1)
        uniq, inverse = torch.unique(flat, return_inverse=True)
        out = self._fetch(uniq, dtype).view(-1, self.chapter_tokens, self.width)
        if not torch.equal(flat, uniq):  # routing passes unique sorted ids: no copy then
            out = out.index_select(0, inverse)
        return out.view(*ids.shape, self.chapter_tokens, self.width)

    def rows(self, index: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The tokens ``index`` (any shape) as ``[*index.shape, width]``: their chapters fetched (collective)."""
        flat = index.reshape(-1)
        uniq, inverse = torch.unique(torch.div(flat, self.chapter_tokens, rounding_mode="floor"), return_inverse=True)
        fetched = self._fetch(uniq, dtype).view(-1, self.width)
        return fetched.index_select(0, inverse * self.chapter_tokens + flat % self.chapter_tokens).view(
            *index.shape, self.width)

    def all(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The whole bank ``[N_m, width]``: every chapter fetched (collective)."""
        ids = torch.arange(self.n_chapters, device=self.sharded.device)
        return self._fetch(ids, dtype).view(self.tokens, self.width)

    @property
    def parameter_count(self) -> int:
        """Numbers of the whole bank (all ranks): N_m x width."""
        return self.tokens * self.width

    def extra_repr(self) -> str:
        return (f"tokens={self.tokens}, width={self.width}, chapters={self.n_chapters}, kind=sharded over "
                f"{self.sharded.world} rank(s)")


# --------------------------------------------------------------------------------------------------
# The trainer's side


def shard_crossattn_banks(model: nn.Module, recipe, device: torch.device | str) -> ShardedChapterBank:
    """``memory.crossattn.bank: sharded``: replace the model's banks by a :class:`ShardedChapterBank`
    (:meth:`ShardedChapterBank.replace_banks`) with the ``bank`` role's AdamW: ``bank_lr``'s peak,
    ``train.optimizer`` betas and eps, ``memory.optimizer.weight_decay`` (what DeepSpeed's optimizer
    gives a replicated bank, :func:`memtrain.parallel.engine.param_groups`). Every rank, before
    DeepSpeed."""
    from memtrain.parallel.engine import peak_lr

    bank = ShardedChapterBank.replace_banks(model.crossattn, device)
    o = recipe.train.optimizer
    bank.build_optimizer(peak_lr(recipe, "bank")[0], tuple(o.betas), o.eps, recipe.memory.optimizer.weight_decay)
    return bank


def chapter_bank_joint_clipping(recipe, precision_name: str) -> bool:
    """Whether the loop clips the anchor and the sharded chapter bank by one global norm.

    A replicated bank is a DeepSpeed parameter, clipped with everything else by one norm
    (``train.grad_clip``); the sharded bank matches that wherever the loop can: ``memory.grad_clip``
    auto (or joint) under ZeRO 1-3 (DeepSpeed clips the anchor by the joint norm, :class:`JointNorm`) or
    fp32 ZeRO 0 (the loop scales both before ``engine.step()``; DeepSpeed's own clipping of the anchor
    that follows is then the identity up to its ``1e-6`` epsilon). bf16 under ZeRO 0 keeps DeepSpeed's
    gradients inside its optimizer: separate (the bank by its own norm); an explicit ``joint`` there is
    a LaunchError. ``separate``, or ``grad_clip`` 0: separate."""
    m = recipe.memory
    if recipe.train.grad_clip <= 0 or m.grad_clip == "separate":
        return False
    zero0_bf16 = recipe.parallel.zero_stage == 0 and precision_name != "fp32"
    if m.grad_clip == "joint" and zero0_bf16:
        raise LaunchError(f"memory.grad_clip joint under ZeRO 0 needs fp32 DeepSpeed gradients, but this run is "
                          f"{precision_name}; set parallel.zero_stage to 1-3, or memory.grad_clip: separate")
    return not zero0_bf16


def latent_bank_state(checkpoint: str | Path, width: int, prefix: str = "crossattn.banks.") -> dict[str, torch.Tensor]:
    """The sharded banks of checkpoint folder ``checkpoint`` as ``LatentBank`` state-dict entries
    ``{f"{prefix}{i}.weight": [tokens, width]}`` (one process, no process group; ``width`` = the banks'
    token width, ``memory.crossattn.dim`` or ``d_model``): for evaluating a sharded run with the
    replicated model, merged into the DeepSpeed module state (which holds no bank) before
    ``model.load_state_dict``."""
    from memtrain.parallel.bank_checkpoint import FOLDER, read_full_state

    state = read_full_state(Path(checkpoint) / FOLDER, moments=False)
    return {f"{prefix}{key}.weight": table.reshape(-1, width) for key, table in state["tables"].items()}


# --------------------------------------------------------------------------------------------------
# The byte model


def _requests(uniq: list[torch.Tensor], world: int) -> tuple[list[int], list[int]]:
    """a[r]: rank r's ids owned by another rank (round robin, g % W); b[r]: other ranks' ids owned by r."""
    a, b = [0] * world, [0] * world
    for q in range(world):
        counts = torch.bincount(uniq[q].reshape(-1) % world, minlength=world).tolist()
        a[q] = sum(counts) - counts[q]
        for r in range(world):
            if r != q:
                b[r] += counts[r]
    return a, b


def predict_chapter_bytes(n_banks: int, row_numel: int, fetches: list[list[tuple[int, torch.Tensor]]],
                          row_bytes: int = 4, grad_bytes: int = 4, id_bytes: int = ID_BYTES) -> list[dict]:
    """Bank bytes each rank sends and receives in one step, as :class:`ShardedChapterBank` counts them.

    ``fetches[r]``: rank r's counted fetches of the step in call order, ``(bank, unique chapter ids)``
    (the same sequence of banks on every rank: one per memory layer per forward); ``row_numel`` =
    ``chapter_tokens x width``; owner of chapter ``c`` = ``c % W``; self-sends excluded. Per fetch, with
    ``a_r`` = rank r's ids owned elsewhere and ``b_r`` = other ranks' ids owned by r:

    - split sizes: ``(W - 1) * 8`` bytes each way;
    - requests: ``a_r`` ids sent, ``b_r`` received;
    - chapters: ``b_r`` rows sent, ``a_r`` received, ``row_numel * row_bytes`` each (storage dtype).

    Per bank at ``reduce_gradients`` (once per step, every bank, fetched or not), with the union of rank
    r's ids of that bank over the step's fetches: split sizes as above, ``a_r`` (id, fp32 gradient row)
    pairs sent and ``b_r`` received (``8 + row_numel * grad_bytes`` each). Returns per rank ``{"sent",
    "received"}``."""
    W = len(fetches)
    out = [{"sent": 0, "received": 0} for _ in range(W)]
    if W == 1:
        return out
    splits = (W - 1) * id_bytes
    calls = len(fetches[0])
    if any(len(f) != calls or [b for b, _ in f] != [b for b, _ in fetches[0]] for f in fetches):
        raise ValueError("every rank must fetch the same banks in the same order")
    rb = row_numel * row_bytes
    for j in range(calls):
        a, b = _requests([fetches[r][j][1] for r in range(W)], W)
        for r in range(W):
            out[r]["sent"] += splits + a[r] * id_bytes + b[r] * rb
            out[r]["received"] += splits + b[r] * id_bytes + a[r] * rb
    gb = id_bytes + row_numel * grad_bytes
    for level in range(n_banks):
        union = []
        for r in range(W):
            mine = [ids.reshape(-1) for l, ids in fetches[r] if l == level]
            union.append(torch.unique(torch.cat(mine)) if mine else torch.empty(0, dtype=torch.int64))
        a, b = _requests(union, W)
        for r in range(W):
            out[r]["sent"] += splits + a[r] * gb
            out[r]["received"] += splits + b[r] * gb
    return out


def zero3_chapter_bytes(bank_params: int, world: int, micro_batches: int, row_bytes: int = 4) -> int:
    """:meth:`ShardedChapterBank.zero3_reference_bytes` from its parts: ``m (W-1)/W P (2 e + 4)``."""
    return micro_batches * (world - 1) * bank_params * (2 * row_bytes + 4) // world


def expected_unique(chapters: int, picks_per_decision: int, decisions: int) -> float:
    """Expected number of distinct chapters when ``decisions`` independent decisions each pick
    ``picks_per_decision`` distinct chapters uniformly: ``C (1 - (1 - k / C)^n)``."""
    return chapters * (1.0 - (1.0 - picks_per_decision / chapters) ** decisions)


__all__ = ["ChapterBankView", "ChapterLayout", "ShardedChapterBank", "chapter_bank_joint_clipping",
           "expected_unique", "latent_bank_state", "predict_chapter_bytes", "shard_crossattn_banks",
           "zero3_chapter_bytes"]
