"""The Titans neural long-term memory layer (LMM): :class:`NeuralMemory`.

Titans (Behrouz, Zhong, Mirrokni 2025), Sections 3.1-3.2 and 4.4. Per token x_t ``[dim]``:

1. projections ``q, k, v = x W_Q, x W_K, x W_V`` (``heads * head_dim`` wide, bias-free), each followed
   by a causal depthwise 1D convolution (kernel ``conv_kernel``; Section 4.4), then SiLU; q and k are
   L2-normalised per head, and v too with ``value_norm=True`` (not in the paper; see "Stability" below);
2. gates per head from x (linear + sigmoid): learning rate ``theta = max_lr * sigmoid(.)``, momentum
   decay ``eta = max_momentum * sigmoid(.)`` (``max_momentum`` 1 by default, as in the paper),
   forgetting ``alpha = sigmoid(.)``. With ``gate_mode="chunk"`` every
   token of a chunk uses the gates of the chunk's *first* token (Section 3.2, "parameters as the
   function of chunks"). The chunk's first token is used rather than e.g. the mean over the chunk
   because a mean would let token t's output depend on later tokens of its chunk (a causality leak
   in a language model);
3. the inner loop (:mod:`memtrain.model.titans.inner_loop`): the memory MLP (depth ``depth``, hidden
   width ``expansion * head_dim``; the paper does not give a width, 2 is our default) is trained on
   ``||M(k_t) - v_t||^2`` with momentum and forgetting, chunk-wise mini-batch gradient descent with
   chunk size ``chunk_size``, and read as ``y_t = M_t(q_t)`` -- with the weights *after* token t's
   update (see the inner-loop docstring);
4. output: RMSNorm per head (learned gain), times a learned sigmoid gate ``sigmoid(x W_G)``, then the
   output projection W_O back to ``dim`` (Section 4.4: normalisation and gating before the output
   projection). No residual connection here -- the surrounding block adds it.

The learnable initial memory weights (``init_weights``, one ``[heads, d_out, d_in]`` per layer) are
outer-loop parameters trained by back-propagation through the inner loop; the initial momentum is 0.
The inner loop runs in float32 with autocast off (float64 if the parameters are float64), whatever
the activation dtype. Document boundaries of packed sequences do not reset the memory (not
implemented here).

Stability. Within a chunk the per-token gradients are *summed* at the chunk-start weights (eq. 16) and
momentum accumulates them, so a persistent gradient direction (correlated keys) moves the weights by
``theta * chunk_size / (1 - eta)`` per unit gradient and chunk; for a deep memory (depth >= 2) the inner
loss's curvature grows with the square of the memory weights, which grow with the value norm ``|v|``
(the weights must map unit keys onto v). Past a threshold in that effective step (about 1.5-2 with
``|v| = 1``, less the larger ``|v|``) the weights run away within a few dozen chunks to inf / NaN, in
float64 as in float32. Nothing in the paper's parameterisation bounds eta or ``|v|``, and the outer
optimizer moves both within a few steps (titans-400m-mag: NaN from step 4). ``value_norm=True`` fixes
``|v| = 1`` (the per-head RMSNorm of the output discards the retrieval's scale anyway) and
``max_momentum`` bounds eta, so with ``theta <= max_lr`` the effective step is at most
``max_lr * chunk_size / (1 - max_momentum)``. The Titans models turn both on
(``model.titans.memory_value_norm``, ``memory_max_momentum``; 0.95 with max_lr 0.003 and chunk 16: at
most 0.96); the core's defaults keep the paper's form (MemoryLlama uses them).

API (what MAC / MAG / MAL use)::

    mem = NeuralMemory(dim, heads=4, depth=2, chunk_size=16)
    y, state = mem(x)                       # x [B, T, dim] -> y [B, T, dim]; fresh state
    y2, state = mem(x2, state)              # continue the same sequence (any split point)
    y_t, state = mem(x_t, state)            # token-by-token generation, x_t [B, 1, dim]
    h = mem.retrieve(x, state)              # read only: M_state(q(x)), state unchanged
    state = state.detach()                  # truncate BPTT between segments

- MAG / MAL / LMM: ``y, state = mem(x, state)``; for MAG combine ``y`` with the sliding-window
  attention output by a gate, for MAL feed ``y`` to the attention.
- MAC, per segment S: ``h = mem.retrieve(S, state)`` queries the memory as it was before the segment
  (eq. 21); attention runs over ``[persistent | h | S]`` giving ``y_seg``; then
  ``o_mem, state = mem(y_seg, state)`` writes the segment to the memory (eq. 24) and returns
  ``M_t(q(y_t))`` per token for the output gating ``o = y_seg * o_mem`` (eq. 25). The MAC block computes
  the same through the pieces of these two calls, so that what does not depend on the state runs once for
  all segments: ``segment_queries`` (every segment's retrieval queries), ``read`` (``M(q)`` with a state's
  weights), ``write`` (the memory's forward up to its output stage) and ``output_gate`` / ``gated_output``
  (the output stage, row by row).

``retrieve`` applies the query convolution to ``x`` alone (zero left padding) rather than to the
state's convolution cache, which holds the *update* stream (e.g. MAC's attention outputs); so
``retrieve`` depends only on ``x`` and the memory weights. For incremental MAC decoding pass the
segment prefix and take the last row.

``forward(..., algorithm="sequential")`` runs the per-token reference loop (for tests and
benchmarks); it returns the same result as ``"chunked"``.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from memtrain.errors import SettingError
from memtrain.kernels.op import requested_mode
from memtrain.kernels.titans import (KERNELS, kernel_unsupported, mlp_hidden, requested_backward, requested_forward,
                                      requested_stages, requested_wave, use_triton)
from memtrain.model import switches
from memtrain.model.grouped_linear import fan_out, grouped_linear
from memtrain.model.titans.inner_loop import ALGORITHMS, memory_scan, mlp_forward
from memtrain.model.titans.state import MemoryState

GATE_MODES = ("token", "chunk")
# MEMTRAIN_TITANS_FUSED_PROLOGUE=0 keeps the prologue (q/k/v and gates) in PyTorch where the scan kernels run: a
# switch for a GPU where the fused prologue fails (the GPU check sets it when its prologue tests fail there).
FUSED_PROLOGUE_ENV = switches.TITANS_FUSED_PROLOGUE


def fused_prologue() -> bool:
    """Whether the layer's prologue runs as :mod:`memtrain.kernels.titans.prologue`'s kernels where the scan's do."""
    return switches.flag(FUSED_PROLOGUE_ENV)


FUSED_OUTPUT_ENV = switches.TITANS_FUSED_OUTPUT


def fused_output() -> bool:
    """Whether the layer's output stage runs as :mod:`memtrain.kernels.titans.output`'s kernels where the scan's
    would."""
    return switches.flag(FUSED_OUTPUT_ENV)


FUSED_READ_ENV = switches.TITANS_FUSED_READ


def fused_read() -> bool:
    """Whether MAC's retrieval (:meth:`NeuralMemory.read` given the activations' half precision) runs as
    :mod:`memtrain.kernels.titans.read`'s kernels where the scan's would."""
    return switches.flag(FUSED_READ_ENV)


FUSED_CONV_ENV = switches.TITANS_FUSED_CONV


def fused_conv() -> bool:
    """Whether the fused q/k/v prologue (:func:`fused_prologue`) takes the causal convolution too
    (:func:`memtrain.kernels.titans.prologue.conv_qkv_heads`), and MAC's retrieval queries run as one kernel with it
    (:func:`~memtrain.kernels.titans.prologue.conv_queries`)."""
    return switches.flag(FUSED_CONV_ENV)


def scan_uses_kernels(q: torch.Tensor, state: MemoryState, algorithm: str, kernel: str,
                      io_dtype: torch.dtype) -> bool:
    """Whether :func:`run_scan` with these arguments runs the Triton kernels (``q`` ``[B, H, T, head_dim]``)."""
    dtype = io_dtype if io_dtype in (torch.bfloat16, torch.float16) else q.dtype
    return use_triton(kernel, q, len(state.weights), algorithm, q.shape[-1], state.weights[0].shape[-2], dtype=dtype)


def run_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lr: torch.Tensor, log_eta: torch.Tensor,
             log_keep: torch.Tensor, state: MemoryState, chunk_size: int, algorithm: str, kernel: str,
             io_dtype: torch.dtype) -> tuple[torch.Tensor, MemoryState]:
    """One call's inner loop (:func:`memory_scan`) outside autocast, ``q``, ``k``, ``v`` in the inner dtype.

    When the Triton kernels run and ``io_dtype`` (the activations' dtype) is bf16 / fp16, they take ``q``,
    ``k``, ``v`` in it (bf16 dot products, fp32 accumulation, gates and state; :meth:`NeuralMemory.write` hands
    them over in it already, cast in the same copy that lays them out); the PyTorch form runs in the inner
    dtype. Compiled Titans blocks trace it when the kernels run (they are custom operators: one node each in
    the block's graph) and call the PyTorch form, a Python loop over chunks, through
    ``torch.compiler.disable`` (:meth:`memtrain.model.titans.arch.TitansLM.compile_blocks`)."""
    if io_dtype in (torch.bfloat16, torch.float16) and io_dtype != q.dtype and use_triton(
            kernel, q, len(state.weights), algorithm, q.shape[-1], state.weights[0].shape[-2], dtype=io_dtype):
        q, k, v = q.to(io_dtype), k.to(io_dtype), v.to(io_dtype)
    with torch.autocast(device_type=q.device.type, enabled=False):
        return memory_scan(q, k, v, lr, log_eta, log_keep, state, chunk_size, algorithm, kernel=kernel)


def compiled_scan() -> Callable[..., tuple[torch.Tensor, MemoryState]]:
    """:func:`run_scan` for compiled blocks: traced into the block's graph where the Triton kernels run, under
    ``torch.compiler.disable`` (one graph break per call) where the PyTorch form does, whose loop over chunks
    Dynamo would otherwise unroll (hundreds of chunks per layer). Imports ``torch._dynamo``: only when
    compiling."""
    eager_scan = torch.compiler.disable(run_scan)

    def scan(q, k, v, lr, log_eta, log_keep, state, chunk_size, algorithm, kernel, io_dtype):
        run = run_scan if scan_uses_kernels(q, state, algorithm, kernel, io_dtype) else eager_scan
        return run(q, k, v, lr, log_eta, log_keep, state, chunk_size, algorithm, kernel, io_dtype)

    return scan


class Projections(NamedTuple):
    """The layer's parameterised maps as callables: ``qkv_gates`` gives ``to_qkv``'s and ``to_gates``' outputs,
    ``conv`` gives the weight and bias of one write's convolution (:meth:`NeuralMemory._conv`), ``out_gain`` gives
    the output norm's gain (``out_norm``) for one :meth:`NeuralMemory.gated_output` call, ``out`` is ``to_out``.
    Its modules (:meth:`NeuralMemory.projections`), or for a forward that calls the layer's pieces many times
    (MAC's segments) one GEMM for both input projections and each parameter's gradient computed or summed once
    (:meth:`NeuralMemory.projections` with ``writes`` / ``outputs``)."""

    qkv_gates: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    conv: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    out_gain: Callable[[], torch.Tensor]
    out: Callable[[torch.Tensor], torch.Tensor]


class NeuralMemory(nn.Module):
    """Titans' neural long-term memory layer; see the module docstring for the math and the API.

    Args:
        dim: model width (input and output).
        heads, head_dim: memory heads and their width (default ``dim // heads``); one memory MLP per head.
        depth: L_M, layers of the memory MLP (1: a matrix memory ``M(k) = W k``).
        expansion: hidden width of the memory MLP in units of ``head_dim`` (depth >= 2).
        chunk_size: mini-batch size b of the inner loop (1: fully online gradient descent).
        gate_mode: ``"token"`` (per-token gates) or ``"chunk"`` (a chunk's first token's gates).
        conv_kernel: width of the causal depthwise convolutions after the q/k/v projections.
        max_lr: upper bound of the inner learning rate theta.
        init_lr, init_momentum, init_forget: theta, eta and alpha at initialisation (gate biases).
        max_momentum: upper bound of the momentum decay eta (1: unbounded, the paper's form).
        value_norm: L2-normalise the values per head like the keys (False: the paper's form).
        kernel: where the chunked inner loop runs: ``"auto"`` (the Triton kernels of
            :mod:`memtrain.kernels.titans` on CUDA for any depth whose layers fit their tiles, PyTorch
            elsewhere), ``"triton"``, ``"torch"``.
    """

    def __init__(
        self,
        dim: int,
        heads: int = 4,
        head_dim: Optional[int] = None,
        depth: int = 2,
        expansion: float = 2.0,
        chunk_size: int = 16,
        gate_mode: str = "token",
        conv_kernel: int = 4,
        max_lr: float = 0.1,
        init_lr: float = 0.01,
        init_momentum: float = 0.9,
        init_forget: float = 0.01,
        kernel: str = "auto",
        max_momentum: float = 1.0,
        value_norm: bool = False,
    ) -> None:
        super().__init__()
        if gate_mode not in GATE_MODES:
            raise ValueError(f"unknown gate_mode {gate_mode!r}; expected one of {', '.join(GATE_MODES)}")
        if depth < 1 or chunk_size < 1 or conv_kernel < 1:
            raise ValueError("depth, chunk_size and conv_kernel must be >= 1")
        if not (0 < init_lr < max_lr and 0 < init_momentum < max_momentum <= 1 and 0 < init_forget < 1):
            raise ValueError("need 0 < init_lr < max_lr, 0 < init_momentum < max_momentum <= 1 and "
                             "init_forget in (0, 1)")
        self.max_momentum, self.value_norm = max_momentum, value_norm
        head_dim = head_dim or dim // heads
        self.dim, self.heads, self.head_dim, self.depth = dim, heads, head_dim, depth
        if kernel not in KERNELS:
            raise ValueError(f"unknown kernel {kernel!r}; expected one of {', '.join(KERNELS)}")
        # a bad MEMTRAIN_TITANS_BACKWARD / _FORWARD / _WAVE / _STAGES or MEMTRAIN_KERNEL_OPS stops the run here, not in
        # its first step
        if kernel != "torch":
            try:
                requested_backward()
                requested_forward()
                requested_wave()
                requested_stages()
                requested_mode()
            except ValueError as e:
                raise SettingError(str(e)) from None
        self.chunk_size, self.gate_mode, self.conv_kernel, self.max_lr = chunk_size, gate_mode, conv_kernel, max_lr
        self.kernel = kernel
        inner = heads * head_dim
        self.inner = inner
        hidden = mlp_hidden(head_dim, expansion)
        sizes = [head_dim] + [hidden] * (depth - 1) + [head_dim]
        why = kernel_unsupported(depth, head_dim, hidden) if kernel == "triton" else None
        if why is not None:
            raise ValueError(f"kernel 'triton': {why}; use kernel 'auto' or 'torch'")

        self.to_qkv = nn.Linear(dim, 3 * inner, bias=False)
        self.conv = nn.Conv1d(3 * inner, 3 * inner, conv_kernel, groups=3 * inner, bias=True)
        self.to_gates = nn.Linear(dim, 3 * heads)  # [lr | eta | alpha] pre-activations, one per head
        self.init_weights = nn.ParameterList(
            [nn.Parameter(torch.empty(heads, d_out, d_in)) for d_in, d_out in zip(sizes[:-1], sizes[1:])])
        self.out_norm = nn.Parameter(torch.ones(heads, head_dim))
        self.to_out_gate = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.Linear(inner, dim, bias=False)
        self._init_gates = (init_lr / max_lr, init_momentum / max_momentum, init_forget)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for w in self.init_weights:
            nn.init.normal_(w, std=1.0 / math.sqrt(w.shape[-1]))
        with torch.no_grad():
            nn.init.normal_(self.to_gates.weight, std=0.02)
            b = self.to_gates.bias.view(3, self.heads)
            for row, p in zip(b, self._init_gates):  # sigmoid(bias) = init_lr / max_lr, eta / max_momentum, alpha
                row.fill_(math.log(p / (1 - p)))

    # ---------------------------------------------------------------------------------------------
    # State

    def init_state(self, batch_size: int, device: Optional[torch.device] = None) -> MemoryState:
        """A fresh state: the learnable initial weights (in the graph), zero momentum, empty conv cache."""
        device = device or self.init_weights[0].device
        weights = tuple(w.to(device, self.inner_dtype).unsqueeze(0).expand(batch_size, *w.shape)
                        for w in self.init_weights)
        cache = torch.zeros(batch_size, self.conv_kernel - 1, 3 * self.inner, device=device,
                            dtype=self.to_qkv.weight.dtype)
        return MemoryState(weights=weights, momentum=tuple(torch.zeros_like(w) for w in weights),
                           chunk_weights=weights, pos=0, chunk_gates=None, conv_cache=cache)

    # ---------------------------------------------------------------------------------------------
    # Pieces

    # The inner loop of a call; TitansLM.compile_blocks sets an instance's to compiled_scan(), which
    # traces it where the Triton kernels run and leaves the PyTorch form to run eagerly.
    scan = staticmethod(run_scan)

    def projections(self, writes: int = 0, outputs: int = 0) -> Projections:
        """The layer's projections, convolution and output gain: its modules, or for a caller that makes
        ``writes`` calls of :meth:`write` and ``outputs`` of :meth:`gated_output` in one forward (MAC: one per
        segment, and one more output stage) ``to_qkv`` and ``to_gates`` stacked into one projection (one GEMM per
        call each way, one input gradient), it and ``to_out`` as
        :func:`~memtrain.model.grouped_linear.grouped_linear` (each weight's gradient one GEMM for all calls), and
        the convolution's weight and bias and ``out_norm`` through :func:`~memtrain.model.grouped_linear.fan_out`
        (their gradients summed in one op each); plain where that does not apply. The same functions either
        way."""
        if not (writes or outputs):
            return Projections(lambda x: (self.to_qkv(x), self.to_gates(x)),
                               lambda: (self.conv.weight, self.conv.bias), lambda: self.out_norm, self.to_out)
        gates = self.to_gates
        split = [self.to_qkv.out_features, gates.out_features]
        both = grouped_linear(torch.cat([self.to_qkv.weight, gates.weight]), F.pad(gates.bias, (split[0], 0)))
        weights, biases = (iter(fan_out(p, writes)) for p in (self.conv.weight, self.conv.bias))
        gains = iter(fan_out(self.out_norm, outputs))
        return Projections(lambda x: both(x).split(split, dim=-1),
                           lambda: (next(weights), next(biases)), lambda: next(gains),
                           grouped_linear(self.to_out.weight))

    @property
    def inner_dtype(self) -> torch.dtype:
        """The inner loop's dtype: float32, or float64 when the parameters are float64."""
        return torch.promote_types(self.init_weights[0].dtype, torch.float32)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, H*d] -> [B, H, T, d]
        return x.unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)

    def _conv(self, xp: torch.Tensor, channels: Optional[slice] = None,
              params: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        """Causal depthwise convolution of ``xp`` [B, kernel-1+T, C], the input after its left context (the
        state's cache, or zeros): [B, T, C]. ``channels``: those of the convolution's ``3 * inner`` that ``xp``
        holds (None: all of them, the parameters themselves; a slice's backward would write a zero-filled
        gradient of the whole parameter and copy its part in, per call). ``params``: the weight and bias to use
        (aliases of the module's, :meth:`projections`)."""
        xp = xp.transpose(1, 2)
        weight, bias = params or (self.conv.weight, self.conv.bias)
        if channels is not None:
            weight, bias = weight[channels], bias[channels]
        return F.conv1d(xp, weight, bias, groups=xp.shape[1]).transpose(1, 2)

    def _queries(self, q: torch.Tensor) -> torch.Tensor:
        return F.normalize(F.silu(self._heads(q)).to(self.inner_dtype), dim=-1)

    def _qkv_heads(self, qkv: torch.Tensor, half: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q, k, v`` ``[B, H, T, head_dim]`` from the convolved ``[B, T, 3*inner]`` in one pass over all three:
        SiLU, the inner dtype, L2 norm per head (q, k; v too with ``value_norm``), as :meth:`_queries` per part.
        One copy lays them out contiguously per head for the inner loop, in the dtype it reads them in: the
        activations' half precision where the Triton kernels run (:func:`run_scan`), else the inner dtype. Where
        the kernels run, all of it is one fused kernel each way (:func:`memtrain.kernels.titans.prologue.qkv_heads`,
        a custom operator: one node in a compiled block's graph, so compiled and eager blocks compute the same).
        ``half``: whether the kernels run and read half precision (:meth:`_kernels_read_half`). :meth:`write` calls
        it after PyTorch's convolution only where the fused one (which takes the convolution too,
        :func:`memtrain.kernels.titans.prologue.conv_qkv_heads`) is switched off."""
        if half and fused_prologue():
            from memtrain.kernels.titans.prologue import qkv_heads
            return qkv_heads(qkv, self.heads, self.value_norm, qkv.dtype)
        B, T, _ = qkv.shape
        a = F.silu(qkv).to(self.inner_dtype).view(B, T, 3, self.heads, self.head_dim)
        if self.value_norm:
            a = F.normalize(a, dim=-1)
        else:
            a = torch.cat([F.normalize(a[:, :, :2], dim=-1), a[:, :, 2:]], dim=2)
        dtype = qkv.dtype if half else self.inner_dtype
        q, k, v = a.permute(2, 0, 3, 1, 4).to(dtype, memory_format=torch.contiguous_format)
        return q, k, v

    def _kernels_read_half(self, qkv: torch.Tensor, algorithm: str) -> bool:
        """Whether the Triton kernels run this call and read its q, k, v in the activations' half precision."""
        return qkv.dtype in (torch.bfloat16, torch.float16) and use_triton(
            self.kernel, qkv, self.depth, algorithm, self.head_dim, self.init_weights[0].shape[-2], dtype=qkv.dtype)

    def _conv_fused(self, half: bool) -> bool:
        """Whether the convolution runs inside the fused prologue's kernels, given whether the scan's run in half
        precision (``half``): unless switched off, for widths up to 16 (``prologue.CONV_MAX_KERNEL``)."""
        return half and fused_prologue() and fused_conv() and self.conv_kernel <= 16

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        """The output's sigmoid gate from ``x`` ``[B, T, dim]``: ``sigmoid(x W_G)`` ``[B, T, H*d]``."""
        return torch.sigmoid(self.to_out_gate(x))

    def gated_output(self, y: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype,
                     proj: Optional[Projections] = None) -> torch.Tensor:
        """[B, H, T, d] retrievals -> per-head RMSNorm, times ``gate`` (:meth:`output_gate`) in ``dtype`` (the
        gating input's), output projection (``proj.out``; None: :meth:`projections`): ``[B, T, dim]``. Row by row,
        so it may run once over several calls' rows (MAC's segments). Where the scan kernels run (half-precision
        activations), eager or compiled: one fused kernel each way up to the projection
        (:func:`memtrain.kernels.titans.output.gated_norm`; 5 ops forward, about 9 backward in this form)."""
        to_out, gain = (self.to_out, self.out_norm) if proj is None else (proj.out, proj.out_gain())
        if gate.dtype == dtype and fused_output() and self._kernels_read_half(gate, "chunked"):
            from memtrain.kernels.titans.output import gated_norm

            return to_out(gated_norm(y, gain, gate))
        y = F.rms_norm(y.transpose(1, 2), (self.head_dim,)) * gain.to(y.dtype)
        return to_out(y.flatten(2).to(dtype) * gate)

    def _output(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[B, H, T, d] retrievals -> per-head RMSNorm, sigmoid gate from x, output projection."""
        return self.gated_output(y, self.output_gate(x), x.dtype)

    def _gates(self, g: torch.Tensor, state: MemoryState, fused: bool = False):
        """Per-token ``(lr, log_eta, log_keep)`` ``[B, H, T]`` and the state's new ``chunk_gates`` from the gate
        projection ``g`` ``[B, T, 3 * heads]`` (``to_gates``' output). ``fused`` (where the kernels run; per-token
        gates): one fused kernel each way (:func:`memtrain.kernels.titans.prologue.gates`), the same function."""
        B, T, _ = g.shape
        if fused and self.gate_mode == "token":
            from memtrain.kernels.titans.prologue import gates

            return (*gates(g, self.heads, self.max_lr, self.max_momentum), None)
        g = g.to(self.inner_dtype).view(B, T, 3, self.heads).permute(0, 3, 1, 2)  # [B, H, T, 3]
        chunk_gates = None
        if self.gate_mode == "chunk":
            C, pos = self.chunk_size, state.pos
            first = (pos + torch.arange(T, device=g.device)) // C * C - pos  # chunk start, relative
            if pos % C:
                if state.chunk_gates is None:
                    raise ValueError("gate_mode 'chunk' continuing a partial chunk needs state.chunk_gates")
                g = torch.cat([state.chunk_gates.unsqueeze(2).to(g.dtype), g], dim=2)
                first = first + 1  # index 0 is now the stored gates (first < 0 -> 0)
            g = g[:, :, first.clamp_min(0)]
            if (pos + T) % C:
                chunk_gates = g[:, :, -1]
        g_lr, g_eta, g_keep = g.permute(3, 0, 1, 2).contiguous()  # one copy: each gate [B, H, T] contiguous
        lr = self.max_lr * torch.sigmoid(g_lr)
        log_eta = F.logsigmoid(g_eta) + math.log(self.max_momentum)  # eta = max_momentum * sigmoid(.)
        return lr, log_eta, F.logsigmoid(-g_keep), chunk_gates

    # ---------------------------------------------------------------------------------------------
    # Forward / retrieve

    def forward(self, x: torch.Tensor, state: Optional[MemoryState] = None,
                algorithm: str = "chunked") -> tuple[torch.Tensor, MemoryState]:
        """Write ``x`` [B, T, dim] into the memory token by token and read ``y_t = M_t(q_t)``.

        Returns ``(y [B, T, dim], new_state)``; ``state=None`` starts from the initial weights.
        """
        y, new_state = self.write(x, state, algorithm)
        return self._output(y, x), new_state

    def write(self, x: torch.Tensor, state: Optional[MemoryState] = None, algorithm: str = "chunked",
              proj: Optional[Projections] = None) -> tuple[torch.Tensor, MemoryState]:
        """:meth:`forward` before its output stage: ``(y [B, H, T, head_dim], new_state)``, the retrievals
        ``M_t(q_t)`` that :meth:`gated_output` turns into ``forward``'s output. ``proj``: the projections to use
        (None: :meth:`projections`; eager MAC passes grouped ones, made once per block forward)."""
        proj = self.projections() if proj is None else proj
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {algorithm!r}; expected one of {', '.join(ALGORITHMS)}")
        B, T, _ = x.shape
        if state is None:
            state = self.init_state(B, x.device)
        qkv, g = proj.qkv_gates(x)
        pad, cache = self.conv_kernel - 1, state.conv_cache.to(qkv.dtype)
        half = self._kernels_read_half(qkv, algorithm)
        if self._conv_fused(half):
            from memtrain.kernels.titans.prologue import conv_qkv_heads

            q, k, v, conv_cache = conv_qkv_heads(qkv, cache, *proj.conv(), self.heads, self.value_norm, qkv.dtype)
        else:
            conv_in = torch.cat([cache, qkv], dim=1)
            conv_cache = conv_in[:, conv_in.shape[1] - pad:]
            q, k, v = self._qkv_heads(self._conv(conv_in, params=proj.conv()), half)
        lr, log_eta, log_keep, chunk_gates = self._gates(g, state, half and fused_prologue())
        y, new_state = self.scan(q, k, v, lr, log_eta, log_keep, state, self.chunk_size, algorithm, self.kernel,
                                 qkv.dtype)
        return y, replace(new_state, chunk_gates=chunk_gates, conv_cache=conv_cache)

    def retrieve(self, x: torch.Tensor, state: Optional[MemoryState] = None) -> torch.Tensor:
        """Read the memory without updating it: ``M(q(x))`` with the state's current weights.

        ``x`` [B, T, dim] is projected to queries (its own causal convolution, zero left padding);
        every row reads the same weights (those after the state's last token, or the initial
        weights when ``state`` is None). Returns ``[B, T, dim]``; the state is not modified.
        """
        return self._output(self.read(self.segment_queries(x, x.shape[1]), state), x)

    def segment_queries(self, x: torch.Tensor, segment_len: int) -> torch.Tensor:
        """:meth:`retrieve`'s queries ``[B, H, T, head_dim]`` of every ``segment_len``-token segment of ``x``
        ``[B, T, dim]`` at once (the last segment may be shorter): the query convolution restarts (zero left
        padding) at every segment start, as if each segment were retrieved on its own. Where the kernels run
        (half-precision activations), the convolution, SiLU and norm are one fused kernel each way
        (:func:`memtrain.kernels.titans.prologue.conv_queries`; ``MEMTRAIN_TITANS_FUSED_CONV=0`` keeps this form)."""
        q = F.linear(x, self.to_qkv.weight[: self.inner])
        if self._conv_fused(self._kernels_read_half(q, "chunked")):
            from memtrain.kernels.titans.prologue import conv_queries

            return conv_queries(q, self.conv.weight[: self.inner], self.conv.bias[: self.inner], self.heads,
                                segment_len, self.inner_dtype)
        B, T, _ = x.shape
        n = -(-T // segment_len)
        if n * segment_len != T:  # zero rows after the end: a causal convolution leaves the rows before unchanged
            q = F.pad(q, (0, 0, 0, n * segment_len - T))
        q = F.pad(q.reshape(B * n, segment_len, self.inner), (0, 0, self.conv_kernel - 1, 0))  # zero left context
        q = self._conv(q, slice(0, self.inner))
        return self._queries(q.reshape(B, n * segment_len, self.inner)[:, :T])

    def read(self, q: torch.Tensor, state: Optional[MemoryState] = None,
             dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """``M(q)`` ``[B, H, T, head_dim]`` for queries ``q`` (:meth:`segment_queries`) with the state's weights
        (the initial weights when ``state`` is None), in the inner dtype with autocast off. ``dtype``: the
        activations' dtype; where it is half precision and the Triton kernels run (MAC's retrievals in bf16
        training), one fused kernel each way (:func:`memtrain.kernels.titans.read.read`: the products at that
        precision with float32 accumulation, as the scan's reads; about 3 ops forward and 7 backward in this form).
        ``MEMTRAIN_TITANS_FUSED_READ=0`` keeps this form."""
        if state is not None:
            weights = state.weights
        else:
            weights = [w.to(self.inner_dtype).unsqueeze(0) for w in self.init_weights]
        if (dtype in (torch.bfloat16, torch.float16) and self.depth <= 2 and q.dtype == torch.float32 and fused_read()
                and use_triton(self.kernel, q, self.depth, "chunked", self.head_dim, self.init_weights[0].shape[-2],
                               dtype=dtype)):
            from memtrain.kernels.titans.read import DOTS, read

            return read(weights, q, DOTS[dtype])
        with torch.autocast(device_type=q.device.type, enabled=False):
            return mlp_forward(weights, q)


__all__ = ["GATE_MODES", "NeuralMemory", "Projections"]
