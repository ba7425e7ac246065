"""Bytes the anchor's DeepSpeed collectives move, per rank and optimizer step.

``comm/anchor_bytes_sent`` / ``comm/anchor_bytes_received`` (TensorBoard, this rank, last step) sit next
to the memory bank's ``comm/bank_bytes_sent|received`` and ``comm/bank_zero3_bytes``
(:mod:`memtrain.parallel.sharded_bank`)::

    anchor_comm = AnchorCommCounter()   # after deepspeed.initialize
    anchor_comm.reset()                 # start of a step: drop what evaluation / checkpoints sent
    ...                                 # engine.backward / engine.step for every micro-batch
    values.update(anchor_comm.stats())  # closes the window: comm/anchor_bytes_sent, ..._received

What is counted. Every collective DeepSpeed issues through ``deepspeed.comm`` (ZeRO 0-3 gradient
all-reduces / reduce-scatters, ZeRO-1/2 all-gathers of the updated partitions, ZeRO-3 parameter
all-gathers, their norm and overflow all-reduces), synchronous or async, counted when it is *issued*
from the shapes of its tensors. Not counted: anything that calls ``torch.distributed`` directly -- the
memory bank's all-to-alls and scalar all-reduces, and the training loop's own loss / metric
all-reduces -- because the hook sits on DeepSpeed's communication backend, not on the process group.

How. Every ``deepspeed.comm`` collective ends in a method of the backend object
``deepspeed.comm.comm.cdb`` (a ``TorchBackend``): ``comm.all_reduce`` -> ``cdb.all_reduce``,
``reduce_scatter_fn`` (ZeRO-3's ``reduce_scatter_coalesced``) -> ``cdb.reduce_scatter_tensor``,
``allgather_fn`` (ZeRO-3's parameter gather) -> ``cdb.all_gather_into_tensor``, and so on, however the
caller imported the function. :func:`install` shadows those methods on that one instance with thin
wrappers that add the op's bytes to per-op running totals and return the original call's result (the
same work handle: async ops stay async). Per op this costs a Python call, a few ``numel()`` and
dictionary updates (1-3 us measured on a slow 2-core CPU, where the ``torch.distributed`` call itself
costs about 40 us of Python and dispatch); no device synchronisation, no events, no timers, nothing that
grows with the run. Nothing is installed with one rank (W == 1): the counters stay at zero for free.

Why not DeepSpeed's own communication logger (``"comms_logger": {"enabled": true, "prof_all": true}``).
It sees the same ``deepspeed.comm`` ops, but ``timed_op`` (deepspeed/comm/comm.py, ``log_wrapper``) runs
``get_accelerator().synchronize()`` after *every* op whenever the logger is enabled (even ops it does
not profile), plus ``cdb.barrier()`` under MPI: on GPU that serialises every async all-gather /
reduce-scatter with compute (ZeRO-3 prefetch and ``overlap_comm`` stop overlapping). It also starts and
stops a timer per op (CUDA events), keeps every latency in lists that grow for the whole run
(``CommsLogger.append``, deepspeed/utils/comms_logging.py) and recomputes
``timers(name).elapsed(reset=False)`` over all past events of that op name at each op (quadratic in the
number of ops); per-step deltas would come from ``deepspeed.comm.comms_logger.comms_dict`` and
``deepspeed.comm.reset_log()`` (``log_summary()`` adds two barriers). It misses only
``deepspeed.comm.all_gather_coalesced`` (not a ``timed_op``; unused by ZeRO in 0.19). Its message size
(``get_msg_size_from_args``, deepspeed/comm/utils.py) is the *input* tensor (or the sum of an input list)
of the op, not what travels: an all-gather's shard, a reduce-scatter's whole input, an all-reduce's
tensor. :meth:`AnchorCommCounter.step_bytes` reports that same quantity as ``msg_bytes`` per op (so the
two can be compared) next to the wire bytes.

Wire bytes per rank (ring algorithms, as NCCL's bus bandwidth and
:meth:`~memtrain.parallel.sharded_bank.ShardedMemoryBank.zero3_reference_bytes`, which counts
``(W - 1) / W`` per all-gather / reduce-scatter). W = size of the op's process group, S = bytes of the
op's tensor (or the sum over a tensor list); each rank sends and receives:

==========================================  ===============================================  ====================
op (``deepspeed.comm`` backend method)      sent                                             received
==========================================  ===============================================  ====================
all_reduce, all_reduce_coalesced,           2 (W - 1) / W x S  (reduce-scatter + all-gather)  same
inference_all_reduce
reduce_scatter_tensor, reduce_scatter       (W - 1) / W x S_input  (= (W - 1) x output)       same
all_gather_into_tensor, all_gather,         (W - 1) x S_input  (= (W - 1) / W x output)       same
all_gather_base, all_gather_coalesced
broadcast (chain from ``src`` in rank       S, except the last rank of the chain              S, except ``src``
order, NCCL's ring broadcast)               (group rank ``src - 1 mod W``)
reduce (the same chain, ending at ``dst``)  S, except ``dst``                                 S, except ``dst + 1``
all_to_all_single, all_to_all               the input minus this rank's own split            the output minus own
send / isend, recv / irecv,                 S (send)                                          S (recv)
batch_isend_irecv (per P2P op)
gather (to ``dst``)                         S, except ``dst``                                 (W - 1) x S at ``dst``
scatter (from ``src``; S = one chunk)       (W - 1) x S at ``src``                            S, except ``src``
barrier, monitored_barrier                  0                                                 0
broadcast_object_list, all_gather_object    0 (pickled size unknown at the call; calls only)  0
==========================================  ===============================================  ====================

Fractions are floored per op (exact for W = 2). Ops on a group of one rank move nothing. Ops issued
between two :meth:`~AnchorCommCounter.step_bytes` calls make one window: call :meth:`reset` at the start
of a step so that evaluation forwards (ZeRO-3 gathers) and checkpoint barriers between steps are not
charged to the next step. The bytes follow the dtypes DeepSpeed actually communicates (fp32 here; under
bf16, bf16 parameter gathers and whatever gradient dtype it reduces in).

What DeepSpeed (0.19) sends per step, as counted (tests/test_comm.py: fp32, P trainable parameters,
m micro-batches per step, G = 2 parameter groups, memtrain's generated config)::

    ZeRO-0: 2 (W-1)/W x 4P                 one all-reduce of the gradients at the boundary (buckets of
                                           5e8 elements), + one fp32 scalar when DeepSpeed clips
    ZeRO-1: 2 (W-1)/W x 4P + (W-1)/W x 4P  all-reduce at the boundary, all-gather of the updated
                                           partitions after the step, + G fp32 norm scalars
    ZeRO-2: m x 2 (W-1)/W x 4P + (W-1)/W x 4P
                                           the gradients are reduced in *every* micro-batch's backward,
                                           and by an all-reduce of the bucket (DeepSpeed's default
                                           use_multi_rank_bucket_allreduce), not a reduce-scatter
    ZeRO-3: m x (W-1)/W x 4P  (reduce-scatter per micro-batch)
            + k x (W-1)/W x 4P  (parameter all-gathers) + 2 fp64 norm scalars

ZeRO-1/2 partitions are padded (each group to a multiple of 2 W elements) and ZeRO-3 pads every parameter
to ceil(numel / W) per rank, so "P" above is the padded count. ZeRO-3's k depends on which parameters
persist (``stage3_param_persistence_threshold``, 1e5 elements in memtrain's config: persistent
parameters are gathered once after each optimizer step, the others in forward, and again in backward
unless still held -- stage3_max_reuse_distance); the first step also traces the module order (extra
gathers and small broadcasts).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

import torch

# Positional parameter names of DeepSpeed's TorchBackend methods (deepspeed/comm/torch.py), without self.
# The backend's methods are wrapped by stage_on_cpu without functools.wraps, so their signatures cannot
# be read at run time; these mirror torch.distributed's and deepspeed.comm's argument order.
_PARAMS: dict[str, tuple[str, ...]] = {
    "all_reduce": ("tensor", "op", "group", "async_op"),
    "inference_all_reduce": ("tensor", "op", "group"),
    "all_reduce_coalesced": ("tensors", "op", "group", "async_op"),
    "reduce": ("tensor", "dst", "op", "group", "async_op"),
    "reduce_scatter": ("output", "input_list", "op", "group", "async_op"),
    "reduce_scatter_tensor": ("output_tensor", "input_tensor", "op", "group", "async_op"),
    "broadcast": ("tensor", "src", "group", "async_op"),
    "broadcast_object_list": ("object_list", "src", "group", "device"),
    "all_gather": ("tensor_list", "tensor", "group", "async_op"),
    "all_gather_into_tensor": ("output_tensor", "input_tensor", "group", "async_op"),
    "all_gather_base": ("output_tensor", "input_tensor", "group", "async_op"),
    "all_gather_coalesced": ("output_tensors", "input_tensors", "group", "async_op"),
    "all_gather_object": ("object_list", "obj", "group"),
    "all_to_all_single": ("output", "input", "output_split_sizes", "input_split_sizes", "group", "async_op"),
    "all_to_all": ("output_tensor_list", "input_tensor_list", "group", "async_op"),
    "send": ("tensor", "dst", "group", "tag"),
    "isend": ("tensor", "dst", "group", "tag"),
    "recv": ("tensor", "src", "group", "tag"),
    "irecv": ("tensor", "src", "group", "tag"),
    "batch_isend_irecv": ("p2p_op_list",),
    "gather": ("tensor", "gather_list", "dst", "group", "async_op"),
    "scatter": ("tensor", "scatter_list", "src", "group", "async_op"),
    "barrier": ("group", "async_op", "device_ids"),
    "monitored_barrier": ("group", "timeout", "wait_all_ranks"),
}

OPS = tuple(_PARAMS)


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _first(a: dict, *keys: str) -> Any:
    for k in keys:
        if k in a:
            return a[k]
    return None


def _own_rows(a: dict, key: str, splits_key: str, rank: int, world: int) -> tuple[int, int]:
    """``(bytes per row, rows that leave / arrive from other ranks)`` of an all-to-all buffer (dim 0)."""
    t = a.get(key)
    if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] == 0:
        return 0, 0
    n = t.shape[0]
    splits = a.get(splits_key)
    own = int(splits[rank]) if splits else n // world
    return _nbytes(t) // n, n - own


# One rule per op: (arguments by name, W, group rank, root's group rank) -> (msg_bytes, sent, received).

def _all_reduce(a, W, rank, root):
    S = _nbytes(_first(a, "tensor", "tensors"))
    x = 2 * (W - 1) * S // W
    return S, x, x


def _reduce_scatter(a, W, rank, root):
    S = _nbytes(_first(a, "input_tensor", "input_list"))
    x = (W - 1) * S // W
    return S, x, x


def _all_gather(a, W, rank, root):
    S = _nbytes(_first(a, "input_tensor", "tensor", "input_tensors"))
    x = (W - 1) * S
    return S, x, x


def _all_to_all_single(a, W, rank, root):
    S = _nbytes(a.get("input"))
    if W == 1:
        return S, 0, 0
    row_in, n_in = _own_rows(a, "input", "input_split_sizes", rank, W)
    row_out, n_out = _own_rows(a, "output", "output_split_sizes", rank, W)
    return S, row_in * n_in, row_out * n_out


def _all_to_all(a, W, rank, root):
    ins, outs = list(a.get("input_tensor_list") or []), list(a.get("output_tensor_list") or [])
    sent = sum(_nbytes(t) for i, t in enumerate(ins) if i != rank)
    received = sum(_nbytes(t) for i, t in enumerate(outs) if i != rank)
    return _nbytes(ins), sent, received


def _chain(a, W, rank, first):
    """A pipelined chain first -> first+1 -> ... (mod W): all but the last send S, all but the first
    receive S."""
    S = _nbytes(a.get("tensor"))
    pos = (rank - first) % W
    return S, (S if pos < W - 1 else 0), (S if pos > 0 else 0)


def _broadcast(a, W, rank, root):
    return _chain(a, W, rank, root or 0)


def _reduce(a, W, rank, root):
    return _chain(a, W, rank, (root or 0) + 1)


def _gather(a, W, rank, root):
    S = _nbytes(a.get("tensor"))
    return (S, 0, (W - 1) * S) if rank == (root or 0) else (S, S, 0)


def _scatter(a, W, rank, root):
    S = _nbytes(a.get("tensor"))
    return (S, (W - 1) * S, 0) if rank == (root or 0) else (S, 0, S)


def _send(a, W, rank, root):
    S = _nbytes(a.get("tensor"))
    return S, S, 0


def _recv(a, W, rank, root):
    S = _nbytes(a.get("tensor"))
    return S, 0, S


def _batch_p2p(a, W, rank, root):
    sent = received = 0
    for p in a.get("p2p_op_list") or []:  # deepspeed.comm.P2POp: op is "isend" or "irecv"
        n = _nbytes(getattr(p, "tensor", None))
        op = getattr(p, "op", None)
        if (op if isinstance(op, str) else getattr(op, "__name__", "")) in ("isend", "send"):
            sent += n
        else:
            received += n
    return sent + received, sent, received


def _nothing(a, W, rank, root):
    return 0, 0, 0


_RULES: dict[str, Callable] = {
    "all_reduce": _all_reduce, "inference_all_reduce": _all_reduce, "all_reduce_coalesced": _all_reduce,
    "reduce_scatter_tensor": _reduce_scatter, "reduce_scatter": _reduce_scatter,
    "all_gather_into_tensor": _all_gather, "all_gather_base": _all_gather, "all_gather": _all_gather,
    "all_gather_coalesced": _all_gather,
    "all_to_all_single": _all_to_all_single, "all_to_all": _all_to_all,
    "broadcast": _broadcast, "reduce": _reduce, "gather": _gather, "scatter": _scatter,
    "send": _send, "isend": _send, "recv": _recv, "irecv": _recv, "batch_isend_irecv": _batch_p2p,
    "barrier": _nothing, "monitored_barrier": _nothing, "broadcast_object_list": _nothing,
    "all_gather_object": _nothing,
}
assert set(_RULES) == set(_PARAMS)
_ROOT = {"broadcast": "src", "reduce": "dst", "gather": "dst", "scatter": "src"}
_NO_GROUP = frozenset(("send", "isend", "recv", "irecv", "batch_isend_irecv", "barrier", "monitored_barrier",
                       "broadcast_object_list", "all_gather_object"))


def wire_bytes(name: str, a: dict, world: int, rank: int, root: Optional[int] = None) -> tuple[int, int, int]:
    """``(msg_bytes, sent, received)`` of one backend call ``name`` with arguments ``a`` (by parameter
    name) on group rank ``rank`` of a group of ``world`` ranks; ``root``: the group rank of ``src`` /
    ``dst`` for broadcast, reduce, gather and scatter (module docstring, the table). ``msg_bytes`` is
    DeepSpeed's comms-logger size (the op's input). Ops on a group of one rank move nothing."""
    if world <= 1 and name not in ("send", "isend", "recv", "irecv", "batch_isend_irecv"):
        return _nbytes(_first(a, "tensor", "tensors", "input_tensor", "input_list", "input", "input_tensor_list")), 0, 0
    return _RULES[name](a, world, rank, root)


def _group_rank(group, global_rank: int) -> int:
    d = torch.distributed
    if group is None or group is d.GroupMember.WORLD or not isinstance(group, d.ProcessGroup):
        return int(global_rank)
    return d.get_group_rank(group, int(global_rank))


class _Hook:
    """Running per-op totals ``[calls, msg_bytes, sent, received, uncounted]`` of one DeepSpeed backend
    instance (``uncounted``: calls whose sizes could not be read; they still run)."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.totals: dict[str, list[int]] = {}
        self.originals: dict[str, Callable] = {}
        self._groups: dict = {}  # process group (None: world) -> (world size, this rank in it)
        for name in OPS:
            method = getattr(backend, name, None)
            if method is None or name in vars(backend):  # absent, or already shadowed by someone
                continue
            self.originals[name] = method
            setattr(backend, name, self._wrap(name, method))

    def _world_rank(self, group) -> tuple[int, int]:
        try:
            return self._groups[group]
        except KeyError:
            pass
        except TypeError:  # unhashable (a rank list): not cached
            group = None
        d = torch.distributed
        if group is not None and not isinstance(group, d.ProcessGroup):
            wr = d.get_world_size(), d.get_rank()
        else:
            wr = d.get_world_size(group), d.get_rank(group)
        self._groups[group] = wr
        return wr

    def count(self, name: str, a: dict) -> tuple[int, int, int]:
        """:func:`wire_bytes` of a call, with the world size and rank of its process group."""
        if name in _NO_GROUP:
            return _RULES[name](a, 1, 0, None)
        group = a.get("group")
        W, rank = self._world_rank(group)
        key = _ROOT.get(name)
        root = _group_rank(group, a.get(key) or 0) if key else None
        return wire_bytes(name, a, W, rank, root)

    def _wrap(self, name: str, method: Callable) -> Callable:
        params = _PARAMS[name]
        totals = self.totals
        count = self.count

        def counted(*args, **kwargs):
            t = totals.get(name)
            if t is None:
                t = totals[name] = [0, 0, 0, 0, 0]
            t[0] += 1
            try:
                a = dict(zip(params, args))
                if kwargs:
                    a.update(kwargs)
                msg, sent, received = count(name, a)
                t[1] += msg
                t[2] += sent
                t[3] += received
            except Exception:  # never let accounting break a collective: note it, run the op
                t[4] += 1
            return method(*args, **kwargs)

        counted.__name__ = name
        counted.__wrapped__ = method
        return counted

    def remove(self) -> None:
        for name in self.originals:
            self.backend.__dict__.pop(name, None)
        self.originals = {}

    def snapshot(self) -> dict[str, tuple[int, ...]]:
        return {k: tuple(v) for k, v in self.totals.items()}


_HOOK: Optional[_Hook] = None


def _backend():
    """DeepSpeed's current communication backend, without importing DeepSpeed (none if not imported)."""
    ds_comm = sys.modules.get("deepspeed.comm.comm")
    return getattr(ds_comm, "cdb", None)


def install() -> Optional[_Hook]:
    """Count every collective of DeepSpeed's current communication backend (idempotent; re-installs on
    a new backend). None when there is nothing to count (one rank, or no backend yet)."""
    global _HOOK
    d = torch.distributed
    if not (d.is_available() and d.is_initialized()) or d.get_world_size() == 1:
        return None
    cdb = _backend()
    if cdb is None:
        return None
    if _HOOK is None or _HOOK.backend is not cdb:
        if _HOOK is not None:
            _HOOK.remove()
        _HOOK = _Hook(cdb)
    return _HOOK


def uninstall() -> None:
    """Restore DeepSpeed's backend methods (counters then stop advancing)."""
    global _HOOK
    if _HOOK is not None:
        _HOOK.remove()
        _HOOK = None


_ZERO = {"sent": 0, "received": 0, "calls": 0, "uncounted": 0, "by_op": {}}


class AnchorCommCounter:
    """Per-step window over the anchor's DeepSpeed collectives on this rank (module docstring).

    Create it after ``deepspeed.initialize`` (which creates DeepSpeed's backend); ``engine`` is accepted
    for symmetry and unused. Reading is local (no communication) and never synchronises the device."""

    def __init__(self, engine=None) -> None:
        self._hook = install()
        self._base: dict[str, tuple[int, ...]] = {}
        self._last: dict = dict(_ZERO)
        self.reset()

    @property
    def active(self) -> bool:
        """False with one rank (or no DeepSpeed backend yet): every window is zero."""
        return self._hook is not None

    def _current(self) -> dict[str, tuple[int, ...]]:
        if self._hook is None or self._hook.backend is not _backend():
            # No backend at construction, or DeepSpeed re-created it: (re)attach; a new hook counts from 0.
            hook = install()
            if hook is not self._hook:
                self._hook, self._base = hook, {}
            if hook is None:
                return {}
        return self._hook.snapshot()

    def reset(self) -> None:
        """Start a new window now, dropping what was issued since the last read."""
        self._base = self._current()

    def step_bytes(self) -> dict:
        """Close the window: this rank's ``sent`` / ``received`` wire bytes, ``calls``, ``uncounted``
        (calls whose sizes could not be read: 0 unless DeepSpeed changed a signature) and ``by_op``
        (``{op: {"calls", "msg_bytes", "sent", "received"}}``, ``msg_bytes`` in DeepSpeed's comms-logger
        convention) since the last :meth:`reset` / :meth:`step_bytes`; then start the next window."""
        now = self._current()
        by_op, uncounted = {}, 0
        for name, v in now.items():
            b = self._base.get(name, (0, 0, 0, 0, 0))
            d = [x - y for x, y in zip(v, b)]
            if d[0]:
                by_op[name] = {"calls": d[0], "msg_bytes": d[1], "sent": d[2], "received": d[3]}
                uncounted += d[4]
        self._base = now
        self._last = {"sent": sum(o["sent"] for o in by_op.values()),
                      "received": sum(o["received"] for o in by_op.values()),
                      "calls": sum(o["calls"] for o in by_op.values()), "uncounted": uncounted, "by_op": by_op}
        return self._last

    def last(self) -> dict:
        """The last closed window (as returned by :meth:`step_bytes`)."""
        return self._last

    def stats(self) -> dict[str, float]:
        """Close the window and return ``comm/anchor_bytes_sent`` / ``comm/anchor_bytes_received``
        (this rank, this step) for the metrics writer."""
        w = self.step_bytes()
        return {"comm/anchor_bytes_sent": float(w["sent"]), "comm/anchor_bytes_received": float(w["received"])}


__all__ = ["AnchorCommCounter", "install", "uninstall", "wire_bytes", "OPS"]
