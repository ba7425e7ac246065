"""The Titans inner loop (Titans, Sections 3.1-3.2): fused Triton kernels, forward and backward, beside their
PyTorch reference and fallback (:mod:`.reference`), and the dispatch between them.

Two kernel pairs: :mod:`.triton_kernels` for memory depth 1 and 2 (every layer's weights and momentum held in
registers) and :mod:`.triton_deep` for depth 3 and more (Section 5.5 varies the depth from 1 to 4; the state
lives in a per-program scratch in global memory, one zero-padded tile per layer). :func:`scan` picks by depth
(:data:`DEEP_KERNEL_MIN_DEPTH`). :mod:`.prologue` fuses the memory layer's elementwise work before the scan (q, k,
v and the gates), which :class:`memtrain.model.titans.memory.NeuralMemory` runs where the scan kernels do.

``kernel``: ``"auto"`` runs the kernels for the ``"chunked"`` algorithm on bfloat16 / float16 CUDA tensors
(bf16 training; when Triton imports and the layers fit the kernels' tiles, :func:`kernel_unsupported`) and the
PyTorch chunked form elsewhere; ``"triton"`` forces the kernels (on CPU only under ``TRITON_INTERPRET=1``; the
tests do; and inside :func:`memtrain.kernels.precompile.compile_only`, which compiles them for a GPU without
launching them; a ValueError naming the limit for a memory whose layers do not fit or the sequential algorithm);
``"torch"`` forces the PyTorch form.

float32 inputs under ``"auto"`` stay in PyTorch: the kernels' IEEE float32 dot products (``"triton"`` with float32
inputs, what the exactness tests use) compile slowly for large tiles (the backward at head size 64, hidden 128,
chunk 64 took over ten minutes in ptxas for sm_90, against seconds in bfloat16) and run on the CUDA cores.

The kernels start at a chunk boundary. A call that starts inside a chunk (``pos % chunk_size != 0``, e.g.
token-by-token decoding) runs the rest of that chunk through the PyTorch form and the remainder through
the kernels; the result is the same function either way.
"""

from __future__ import annotations

import contextlib
import os

import torch

from memtrain.kernels import precompile
from memtrain.kernels.titans import reference
from memtrain.kernels.titans.reference import ALGORITHMS

KERNELS = ("auto", "triton", "torch")
# The kernels hold a layer's weights as one tile. Depth 1-2: head size x hidden width, each rounded up to a
# power of two, at most this many elements (head size 128 with hidden 256; the recipes use 64 x 128).
KERNEL_MAX_TILE = 128 * 256
# Depth 3+: every layer padded to one square tile of the larger of the two (rounded up), at most this wide (a
# 256-wide tile's bf16 dot operands alone would exceed an H100's shared memory). MemoryLlama's one 2048-wide
# head stays in PyTorch.
DEEP_KERNEL_MAX_WIDTH = 128
# Memories at least this deep run the any-depth kernels (:mod:`.triton_deep`); the benchmark lowers it to time
# them at depth 2 as well.
DEEP_KERNEL_MIN_DEPTH = 3


def _pow2(x: int) -> int:
    return 1 << max(4, (x - 1).bit_length())


def kernel_fits(head_dim: int, hidden: int, depth: int = 2) -> bool:
    """Whether a memory of ``depth`` layers with this head size and hidden width (depth 1: the head size) fits
    the kernels' tiles."""
    if depth >= DEEP_KERNEL_MIN_DEPTH:
        return max(_pow2(head_dim), _pow2(hidden)) <= DEEP_KERNEL_MAX_WIDTH
    return _pow2(head_dim) * _pow2(hidden) <= KERNEL_MAX_TILE


def mlp_hidden(head_dim: int, expansion: float) -> int:
    """The hidden width of a memory MLP (:class:`memtrain.model.titans.NeuralMemory`): ``expansion x head_dim``,
    rounded, at least 1."""
    return max(1, int(round(expansion * head_dim)))


def kernel_unsupported(depth: int, head_dim: int, hidden: int, algorithm: str = "chunked") -> str | None:
    """Why the kernels cannot run this memory (``None`` when they can): the sequential algorithm, or layers
    wider than the kernels' tiles. ``hidden`` is ignored for depth 1."""
    hidden = hidden if depth > 1 else head_dim
    if algorithm != "chunked":
        return f"the Triton kernels run the chunked algorithm, got algorithm {algorithm!r}"
    if not kernel_fits(head_dim, hidden, depth):
        limit = (f"head size and hidden width up to {DEEP_KERNEL_MAX_WIDTH} at depth {DEEP_KERNEL_MIN_DEPTH}+"
                 if depth >= DEEP_KERNEL_MIN_DEPTH else
                 f"head size x hidden width (powers of two) up to {KERNEL_MAX_TILE} at depth 1-2")
        return (f"the Triton kernels take a memory with {limit}, got depth {depth}, head size {head_dim}, hidden "
                f"{hidden}")
    return None


# MEMTRAIN_TITANS_BACKWARD=shipped|lean|split picks the depth-1/2 kernels' backward form for a run without changing
# the code (:func:`.triton_kernels.backward_form`; tools/gpu_check.py times a whole recipe with the split one).
BACKWARD_ENV = "MEMTRAIN_TITANS_BACKWARD"
BACKWARD_FORMS = ("shipped", "lean", "split")


def requested_backward() -> str | None:
    """The backward form :data:`BACKWARD_ENV` asks for, None where it is unset; ValueError (one line) for another
    value. A memory that may run the kernels checks it when it is built, so a bad value stops a run before its
    first step rather than inside its first backward."""
    form = os.environ.get(BACKWARD_ENV, "")
    if form and form not in BACKWARD_FORMS:
        raise ValueError(f"{BACKWARD_ENV}={form!r}: expected one of {', '.join(BACKWARD_FORMS)} (or unset it)")
    return form or None


# MEMTRAIN_TITANS_FORWARD=shipped|split picks the depth-1/2 kernels' forward form the same way
# (:func:`.triton_kernels.forward_form`).
FORWARD_ENV = "MEMTRAIN_TITANS_FORWARD"
FORWARD_FORMS = ("shipped", "split")


def requested_forward() -> str | None:
    """The forward form :data:`FORWARD_ENV` asks for, None where it is unset; ValueError (one line) for another
    value, checked where :func:`requested_backward` is."""
    form = os.environ.get(FORWARD_ENV, "")
    if form and form not in FORWARD_FORMS:
        raise ValueError(f"{FORWARD_ENV}={form!r}: expected one of {', '.join(FORWARD_FORMS)} (or unset it)")
    return form or None


# MEMTRAIN_TITANS_WAVE=K: the depth-1/2 kernels that run one program per sequence and head through every chunk (the
# shipped forward, the shipped and lean backward) launch at most K programs at a time, in successive launches over the
# sequences and heads. Each program's spilled registers live in a stack frame in local memory, cached in the L2, and
# every running program keeps its frame live: at the recipes' shapes the backward's frames come to about 1 MiB per
# program, 48-97 MiB for 48-96 programs against an H100's / H200's 50 MB L2 (docs/titans-kernels.md, "Where the spills
# live"). Waves bound that. The programs are independent, so the result is the same bit for bit. Unset (or 0): one
# launch. A multiple of 8, so that each wave's tensors start as aligned as the whole's (the same compiled binary).
WAVE_ENV = "MEMTRAIN_TITANS_WAVE"
WAVE_MULTIPLE = 8


def requested_wave() -> int:
    """The programs per launch :data:`WAVE_ENV` asks for, 0 (one launch) where it is unset; ValueError (one line) for
    a value that is not 0 or a positive multiple of :data:`WAVE_MULTIPLE`, checked where :func:`requested_backward`
    is."""
    raw = os.environ.get(WAVE_ENV, "").strip()
    if not raw:
        return 0
    try:
        wave = int(raw)
    except ValueError:
        wave = -1
    if wave < 0 or wave % WAVE_MULTIPLE:
        raise ValueError(f"{WAVE_ENV}={raw!r}: expected programs per launch, a multiple of {WAVE_MULTIPLE} (or 0 or "
                         f"unset for one launch)")
    return wave


# MEMTRAIN_TITANS_STAGES=S (1, 2 or 3): Triton's software pipelining (``num_stages``) of the split kernels' loops over
# chunks, which the kernels otherwise compile without (1; :func:`.triton_kernels._launch_shape` says why): the loads of
# the next chunk's tiles (its keys, coefficients, chunk-start state and per-token factors) are issued asynchronously
# into shared memory while the current chunk computes, instead of each chunk waiting on its own loads. Those loops run
# one program per sequence and head, and on the H200 each program's own chain of dependent loads and products bounded
# them (docs/titans-kernels.md, "Measured: the forms and waves"). The split backward's recompute loop and the split
# forward's recurrence take S; the split backward's carried loop takes at most 2 and only at chunks of up to 16 tokens,
# where its double-buffered tiles fit an A100's shared memory (:func:`.triton_kernels.loop_stages`). Unset: 1, as
# shipped; another value stops the run where a bad MEMTRAIN_TITANS_BACKWARD does. The result is the same: only the
# order in which the loads are issued changes.
STAGES_ENV = "MEMTRAIN_TITANS_STAGES"
MAX_STAGES = 3


def requested_stages() -> int:
    """The pipelining stages :data:`STAGES_ENV` asks for, 1 (none) where it is unset; ValueError (one line) for a value
    other than 1 to :data:`MAX_STAGES`, checked where :func:`requested_backward` is."""
    raw = os.environ.get(STAGES_ENV, "").strip()
    if not raw:
        return 1
    if raw not in {str(i) for i in range(1, MAX_STAGES + 1)}:
        raise ValueError(f"{STAGES_ENV}={raw!r}: expected the split kernels' pipelining stages, 1 to {MAX_STAGES} "
                         f"(or unset it for 1)")
    return int(raw)


# The depth-1/2 kernels' forms, as the benchmarks and the GPU check compare them: the backward's three, the split one
# with the forward split too, and ``pipelined``: the split forward and backward with their loops over chunks
# pipelined in 2 stages. Each is a setting of the three variables above.
FORMS = ("shipped", "lean", "split", "pipelined")


def form_env(form: str) -> dict[str, str]:
    """The settings of :data:`FORWARD_ENV`, :data:`BACKWARD_ENV` and :data:`STAGES_ENV` that pick ``form``, one of
    :data:`FORMS`."""
    if form not in FORMS:
        raise ValueError(f"unknown kernel form {form!r}; expected one of {', '.join(FORMS)}")
    split = form in ("split", "pipelined")
    return {FORWARD_ENV: "split" if split else "shipped", BACKWARD_ENV: "split" if split else form,
            STAGES_ENV: "2" if form == "pipelined" else "1"}


@contextlib.contextmanager
def kernel_form(form: str, wave: int | None = None):
    """Within the block the depth-1/2 kernels run ``form`` (:func:`form_env`), and with ``wave`` that many programs
    per launch (:data:`WAVE_ENV`; 0: one launch), set as a run sets them, through the environment; the variables
    are restored after."""
    env = form_env(form) if wave is None else {**form_env(form), WAVE_ENV: str(wave)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, x in saved.items():
            if x is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = x


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(kernel: str, q: torch.Tensor, depth: int, algorithm: str = "chunked", head_dim: int = 64,
               hidden: int = 128, dtype: torch.dtype | None = None) -> bool:
    """Whether ``kernel`` runs the Triton kernels for tensors like ``q`` (in ``dtype``, default ``q``'s) and a
    memory of ``depth`` layers of ``head_dim`` and ``hidden`` width (ValueError for an unknown ``kernel``; a
    ValueError / RuntimeError when ``triton`` is asked for where it cannot run)."""
    if kernel not in KERNELS:
        raise ValueError(f"Titans memory kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel == "torch":
        return False
    why = kernel_unsupported(depth, head_dim, hidden, algorithm)
    if kernel == "auto":  # half-precision inputs (bf16 training); float32 / float64 stay in PyTorch
        half = (dtype or q.dtype) in (torch.bfloat16, torch.float16)
        return why is None and q.is_cuda and half and triton_available()
    if why is not None:
        raise ValueError(f"Titans memory kernel 'triton': {why}; use kernel 'auto' or 'torch'")
    if not triton_available():
        raise RuntimeError("Titans memory kernel 'triton' needs the triton package")
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1" and not precompile.ACTIVE:
        raise RuntimeError("Titans memory kernel 'triton' on CPU tensors needs TRITON_INTERPRET=1 (the Triton "
                           "interpreter); use 'auto' or 'torch' on CPU")
    return True


def scan(q, k, v, lr, log_eta, log_keep, w, s, wg, pos: int, chunk_size: int, algorithm: str = "chunked",
         kernel: str = "auto"):
    """``(y, w, s, wg)`` of the inner loop over ``q``, ``k``, ``v`` ``[N, T, head_dim]`` from absolute position
    ``pos`` (the shapes of :mod:`.reference`); ``kernel`` picks where it runs (module docstring)."""
    if not use_triton(kernel, q, len(w), algorithm, head_dim=w[0].shape[-1], hidden=w[0].shape[-2]):
        return reference.scan(q, k, v, lr, log_eta, log_keep, w, s, wg, pos, chunk_size, algorithm)
    if len(w) >= DEEP_KERNEL_MIN_DEPTH:
        from memtrain.kernels.titans.triton_deep import chunk_scan
    else:
        from memtrain.kernels.titans.triton_kernels import chunk_scan

    T = q.shape[1]
    lead = min((chunk_size - pos % chunk_size) % chunk_size, T)
    ys = []
    if lead:  # finish the chunk the state is in with the PyTorch form, then start aligned
        head, dt = slice(0, lead), w[0].dtype
        y, w, s, wg = reference.scan(q[:, head].to(dt), k[:, head].to(dt), v[:, head].to(dt), lr[:, head],
                                     log_eta[:, head], log_keep[:, head], w, s, wg, pos, chunk_size, algorithm)
        ys.append(y)
    if lead < T:
        tail = slice(lead, T)
        y, w, s, wg = chunk_scan(q[:, tail], k[:, tail], v[:, tail], lr[:, tail], log_eta[:, tail],
                                 log_keep[:, tail], w, s, chunk_size)
        ys.append(y)
    return (ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)), w, s, wg


__all__ = ["ALGORITHMS", "DEEP_KERNEL_MAX_WIDTH", "DEEP_KERNEL_MIN_DEPTH", "KERNELS", "KERNEL_MAX_TILE", "kernel_fits",
           "kernel_unsupported", "mlp_hidden", "scan", "triton_available", "use_triton"]
