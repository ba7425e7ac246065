"""MemoryLlama: Titans neural memory injected into a pre-trained Hugging Face Llama.

Reference: "Neural Memory Augmentation for Large Language Models" (MemoryLlama thesis), Section 4.1.3
(memory-augmented decoder block), Section 4.1.4 (injection strategies), Section 4.2 (training,
monitoring, evaluation protocol). The memory itself is :class:`memtrain.model.titans.NeuralMemory`.

The gated memory block (thesis Section 4.1.3)
-------------------------------------------
In an injected decoder layer, with ``x_t`` the layer input (the residual stream) and ``t`` one
forward call (a segment, as in Titans' MAC, eq. 21-25 of the Titans paper)::

    q_t   = x_t W_q                                    (4.1)  NeuralMemory's query projection
    h_t   = M*_{t-1}(q_t)                              (4.2)  NeuralMemory.retrieve(x_t, state_{t-1})
    x~_t  = Concat(RMSNorm(x_t), h_t)                  (4.3)  RMSNorm = the layer's input_layernorm
    x_DP  = x~_t W_DP = RMSNorm(x_t) W_x + h_t W_h     (4.4)  W_DP = [W_x; W_h], two d x d matrices
    a_t   = Attn(x_DP)                                 (4.5)  the layer's (frozen / LoRA) self_attn
    M_t   = Update(M_{t-1}; a_t)                       (4.6)  NeuralMemory.forward(a_t, state_{t-1})
    m_t   = M*_t(a_t)                                  (4.7)  ... its output (read after the update)
    g_t   = sigmoid(a_t W_g + b_g)                     (4.8)  per token and channel (W_g is d x d)
    y_t   = (1 - g_t) * a_t + g_t * m_t                (4.9)
    o_t   = y_t + x_t                                  (4.10, see below)

then the rest of the Llama layer (post-attention RMSNorm, SwiGLU MLP, residual) runs unchanged.

Initialisation ("Initialisation" paragraph of Section 4.1.3): ``W_x = I``, ``W_h = 0``, ``W_g = 0``,
``b_g = -6`` (``gate_bias_init``). Then ``x_DP = RMSNorm(x_t)`` exactly and ``g_t = sigmoid(-6) =
2.47e-3``, so ``y_t = a_t + g_t (m_t - a_t)`` -- *approximately* ``a_t`` (the thesis's eq. 4.11 says
"≈"). Two consequences the thesis glosses over:

1. Eq. 4.9 with a finite ``b_g`` is never exactly the identity: at ``b_g = -6`` the block perturbs
   the attention output by ``2.5e-3 (m_t - a_t)``, so the logits differ from the base model's at
   the 1e-3 level, not 1e-5. They equal the base model's to float32 precision when the gate is
   closed (``gate_bias_init <= -30``: ``sigmoid(-30) = 9e-14``); everything else in the block (W_x,
   W_h, the residual) is an exact identity at initialisation. The tests check both.
2. Eq. 4.10 as printed, ``o_t = y_t + x_DP``, takes the residual from ``x_DP = RMSNorm(x_t)``
   instead of from ``x_t`` (Llama's pre-norm residual), which would replace the residual stream by
   its normalised version and contradict the thesis's own claim that the initialised block "behaves
   identically to the original layer". The default ``residual="input"`` keeps Llama's residual
   (``o_t = y_t + x_t``; identical to eq. 4.10 whenever ``x_DP = x_t``); ``residual="x_dp"``
   implements eq. 4.10 literally (not an identity at initialisation).

Injection positions (Section 4.1.4 / 4.2.1; ``layers`` overrides, 0-based indices into
``model.model.layers``):

- ``"elma"`` (embedding-level): the first two blocks ``[0, 1]`` -- block 0's input is the token
  embeddings. (Table B.2 lists ``memory_layer_id [1, 2]`` while the text says "the first and
  second decoder blocks"; we follow the text.)
- ``"alma"`` (attention-level): the second-to-last and last blocks ``[N-2, N-1]`` (Table B.1:
  ``[14, 15]`` for the 16-block Llama-3.2-1B).
- ``"gema"`` (generalised): one module every ``every`` blocks, ``[0, every, 2 every, ...]``.

Implementation: no Hugging Face code is copied. Each injected layer ``model.model.layers[i]`` gets a
child module ``memory_block`` (:class:`GatedMemoryBlock`; state-dict keys
``model.layers.{i}.memory_block.*``, the base keys are unchanged) and three hooks:

- a forward pre-hook on the decoder layer: reads ``x_t`` and the KV cache (to detect a new sequence)
  and picks the memory state the call starts from;
- a forward hook on ``layer.input_layernorm``: replaces ``RMSNorm(x_t)`` by ``x_DP`` (4.1-4.4);
- a forward hook on ``layer.self_attn``: replaces the attention output ``a_t`` by ``y_t`` (4.6-4.9),
  plus ``x_DP - x_t`` with ``residual="x_dp"``, so the layer's own ``residual + ...`` gives ``o_t``.

Memory state (Section 4.2.3's protocol: memory weights and momentum reset per sample)
----------------------------------------------------------------------------------
The memory state ``(M, S, conv cache)`` is per batch element (``[B, heads, ...]``), so samples of a
batch never share memory. Each :class:`GatedMemoryBlock` has a ``mode`` (:func:`set_memory_mode`):

- ``"auto"`` (default): a forward that starts a sequence (no KV cache, or an empty one) starts from
  the initial state ``M_0`` (the learnable initial memory weights), zero momentum and an empty
  convolution cache; the state then flows across the whole sequence inside the forward (chunked
  inner loop). Training forwards never carry state across batches. In eval mode the final state is
  kept so that a KV-cached continuation (``generate``'s decoding steps) continues the memory of the
  same sample; the next new sequence resets it. So every ``generate`` / evaluation forward of a new
  sample starts from a reset memory without any call. Decoding with ``use_cache=False`` re-runs
  the whole prefix, which resets the memory each step (the training-time semantics).
- ``"stream"``: the state is carried across forward calls (detached: truncated BPTT in training)
  until :func:`reset_memory` -- for feeding one long sample in segments without a KV cache. Call
  ``reset_memory(model)`` between samples.
- ``"per_forward"``: every forward starts from the initial state, even KV-cached continuations.

Within one forward ``h_t`` (4.2) reads the state the forward started from (``M_0`` for a new
sequence) for every token, while ``m_t`` (4.7) reads the memory after each token's own update; in
a KV-cached continuation ``h`` of each new token reads the memory after the whole prefix. Beam
search is not supported (the cache is reordered, the memory state is not).

Monitoring: :func:`gate_stats` returns the Section 4.2.2 statistics of the last forward as
TensorBoard scalars. Optimiser: :func:`param_groups` (separate learning rates for memory and LoRA).
Loading: :func:`load_memory_llama` (frozen base, optional ``peft`` LoRA, optionally frozen), or
:func:`augment` on an already loaded model. The learning-rate schedule (cosine with warmup) and
gradient clipping are the training loop's job: in memtrain, ``memory.type: memory_llama`` recipes
(:class:`memtrain.model.hf.MemoryLlamaLM`, :func:`memtrain.parallel.engine.build_optimizer`).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Union

import torch
from torch import nn

from memtrain.model.titans.memory import NeuralMemory
from memtrain.model.titans.state import MemoryState

POSITIONS = ("elma", "alma", "gema")
MODES = ("auto", "stream", "per_forward")
RESIDUALS = ("input", "x_dp")
THESIS_GATE_BIAS = -6.0
THESIS_LORA = {  # Section 4.2.1 / Table B.1
    "r": 16, "lora_alpha": 32, "lora_dropout": 0.05,
    "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
# Section 4.2.1 / Table B.1: one two-layer SiLU MLP with expansion 2 on the full hidden width (one head), the
# inner learning rate at most max_adaptive_lr 1e-2; the default of the library functions' ``memory_kwargs``
# (memory.memory_llama's defaults are the same; NeuralMemory's own are Titans', 4 heads and max_lr 0.1).
THESIS_MEMORY = {"heads": 1, "depth": 2, "expansion": 2.0, "chunk_size": 16, "gate_mode": "token", "conv_kernel": 4,
                 "max_lr": 0.01, "init_lr": 0.005}
STAT_PREFIX = "memory_module"
_STARTS_KEPT = 16  # the start states kept for activation checkpointing's recomputation (GatedMemoryBlock)


def _in_backward() -> bool:
    """Whether autograd's engine is running this code: activation checkpointing's recomputation of a forward."""
    return torch._C._current_graph_task_id() != -1
_EPS = 1e-6


def default_layers(position: str, num_layers: int, every: int = 2) -> list[int]:
    """The decoder blocks (0-based) a position injects memory into, for a stack of ``num_layers``."""
    if position not in POSITIONS:
        raise ValueError(f"unknown position {position!r}; expected one of {', '.join(POSITIONS)}")
    if num_layers < 1:
        raise ValueError("num_layers must be >= 1")
    if position == "elma":
        return list(range(min(2, num_layers)))
    if position == "alma":
        return list(range(max(0, num_layers - 2), num_layers))
    if every < 1:
        raise ValueError("every must be >= 1")
    return list(range(0, num_layers, every))


class GatedMemoryBlock(nn.Module):
    """The memory part of a MemoryLlama decoder block (eq. 4.1-4.10; see the module docstring).

    Parameters: ``memory`` (the Titans memory: W_q/W_k/W_v, gates eta/theta/alpha, initial memory
    weights, output norm/gate/projection), ``w_x`` (W_x, identity init), ``w_h`` (W_h, zero init),
    ``w_g`` (W_g zero and b_g = ``gate_bias_init``). Activations are cast to the block's parameter
    dtype and back, so a float32 block can sit in a bfloat16 model.
    """

    def __init__(self, hidden_size: int, layer_idx: int, memory_kwargs: Optional[dict] = None,
                 gate_bias_init: float = THESIS_GATE_BIAS, residual: str = "input", track_stats: bool = True) -> None:
        super().__init__()
        if residual not in RESIDUALS:
            raise ValueError(f"unknown residual {residual!r}; expected one of {', '.join(RESIDUALS)}")
        self.hidden_size, self.layer_idx = hidden_size, layer_idx
        self.gate_bias_init, self.residual, self.track_stats = float(gate_bias_init), residual, track_stats
        self.memory = NeuralMemory(hidden_size, **{**THESIS_MEMORY, **dict(memory_kwargs or {})})
        self.w_x = nn.Linear(hidden_size, hidden_size, bias=False)  # W_x (first half of W_DP)
        self.w_h = nn.Linear(hidden_size, hidden_size, bias=False)  # W_h (second half of W_DP)
        self.w_g = nn.Linear(hidden_size, hidden_size, bias=True)   # W_g, b_g
        self.mode = "auto"
        self.state: Optional[MemoryState] = None  # carried state (see the module docstring)
        self._ctx: Optional[dict] = None          # the current call: x_t, x_DP, the state it starts from
        # The state each recent training forward started from, by its input's storage: activation checkpointing
        # recomputes the forward in backward from the same input, after self.state has moved on ("stream").
        self._starts: dict[tuple, Optional[MemoryState]] = {}
        self._stats: Optional[dict[str, torch.Tensor]] = None
        self._handles: list = []
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Identity initialisation: W_x = I, W_h = 0, W_g = 0, b_g = gate_bias_init (Section 4.1.3)."""
        with torch.no_grad():
            self.w_x.weight.copy_(torch.eye(self.hidden_size))
            self.w_h.weight.zero_()
            self.w_g.weight.zero_()
            self.w_g.bias.fill_(self.gate_bias_init)

    def extra_repr(self) -> str:
        return f"layer_idx={self.layer_idx}, residual={self.residual!r}, mode={self.mode!r}"

    def reset_memory(self) -> None:
        """Drop the carried state: the next forward starts from M_0, zero momentum, empty conv cache."""
        self.state, self._ctx = None, None
        self._starts.clear()

    # ---------------------------------------------------------------------------------------------
    # The three stages of Section 4.1.3

    def read(self, x: torch.Tensor, normed: torch.Tensor, state: Optional[MemoryState]) -> torch.Tensor:
        """Stage 1, eq. 4.1-4.4: ``x_DP = RMSNorm(x) W_x + M*_{t-1}(x W_q) W_h``."""
        dt = self.w_x.weight.dtype
        h = self.memory.retrieve(x.to(dt), state)                      # (4.1)-(4.2)
        return self.w_x(normed.to(dt)) + self.w_h(h.to(dt))            # (4.3)-(4.4)

    def write_and_gate(self, a: torch.Tensor, state: Optional[MemoryState]):
        """Stages 2-3, eq. 4.6-4.9: returns ``(y, g, m, new_state)``."""
        dt = self.w_g.weight.dtype
        a = a.to(dt)
        m, new_state = self.memory(a, state)                           # (4.6)-(4.7)
        g = torch.sigmoid(self.w_g(a))                                 # (4.8)
        y = (1 - g) * a + g * m.to(dt)                                 # (4.9)
        return y, g, m, new_state

    # ---------------------------------------------------------------------------------------------
    # Hooks

    def _starts_sequence(self, kwargs: dict) -> bool:
        cache = kwargs.get("past_key_values", kwargs.get("past_key_value"))
        if cache is None or not hasattr(cache, "get_seq_length"):
            return True
        return cache.get_seq_length(self.layer_idx) == 0

    def _initial_state(self, x: torch.Tensor, kwargs: dict) -> Optional[MemoryState]:
        if self.mode == "per_forward" or (self.mode == "auto" and self._starts_sequence(kwargs)):
            return None
        state = self.state
        if state is not None and state.batch_size != x.shape[0]:
            raise ValueError(f"memory_block {self.layer_idx}: carried memory state has batch size "
                             f"{state.batch_size}, input has {x.shape[0]}; call reset_memory(model)")
        return state

    def _layer_pre_hook(self, module: nn.Module, args: tuple, kwargs: dict):
        x = args[0] if args else kwargs["hidden_states"]
        key = (x.data_ptr(), tuple(x.shape))  # a recomputation's input shares the forward's storage
        if _in_backward():  # activation checkpointing recomputes this forward: start where it started
            if key not in self._starts:
                raise RuntimeError(f"memory_block {self.layer_idx}: a recomputation in backward (activation "
                                   "checkpointing) of a forward this block did not see")
            self._ctx = {"x": x, "state": self._starts[key], "recomputed": True}
            return None
        state = self._initial_state(x, kwargs)
        if self.training:  # (a reentrant checkpoint runs the forward without gradients)
            self._starts.pop(key, None)
            self._starts[key] = state
            while len(self._starts) > _STARTS_KEPT:
                del self._starts[next(iter(self._starts))]
        self._ctx = {"x": x, "state": state}
        return None

    def _norm_hook(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        ctx = self._ctx
        if ctx is None:
            raise RuntimeError("memory_block: input_layernorm ran outside its decoder layer's forward")
        x = args[0]
        x_dp = self.read(x, output, ctx["state"]).to(output.dtype)
        ctx["x"], ctx["x_dp"] = x, x_dp
        return x_dp

    def _attn_hook(self, module: nn.Module, args: tuple, output: Any):
        ctx, self._ctx = self._ctx, None
        if ctx is None or "x_dp" not in ctx:
            raise RuntimeError("memory_block: self_attn ran without the memory read (input_layernorm hook)")
        a = output[0] if isinstance(output, tuple) else output
        y, g, m, new_state = self.write_and_gate(a, ctx["state"])
        recomputed = ctx.get("recomputed", False)  # the forward already moved the state on and recorded stats
        if not recomputed and (self.mode == "stream" or (self.mode == "auto" and not self.training)):
            self.state = new_state.detach()
        if self.track_stats and not recomputed:
            self._record_stats(ctx["x"], a, g, m)
        out = y.to(a.dtype)
        if self.residual == "x_dp":  # eq. 4.10 literally: the layer adds x_t, so add x_DP - x_t
            out = out + (ctx["x_dp"] - ctx["x"])
        return (out,) + tuple(output[1:]) if isinstance(output, tuple) else out

    @torch.no_grad()
    def _record_stats(self, x: torch.Tensor, a: torch.Tensor, g: torch.Tensor, m: torch.Tensor) -> None:
        g, a, m, x = g.float(), a.float(), m.float(), x.float()
        mem, att = g * m, (1 - g) * a
        per_token = mem.norm(dim=-1) / (att.norm(dim=-1) + _EPS)
        self._stats = {
            "gate_mean": g.mean(), "gate_std": g.std(unbiased=False), "gate_min": g.min(), "gate_max": g.max(),
            "contribution": mem.norm() / (att.norm() + _EPS),           # eq. 4.12
            "contribution_per_token": per_token.mean(),                 # eq. 4.13
            "residual_ratio": mem.norm() / (x.norm() + _EPS),           # ||g m|| / ||x_t||
        }

    def stats(self) -> dict[str, float]:
        """The last forward's gate / contribution statistics and the current weight norms."""
        out = {k: float(v) for k, v in (self._stats or {}).items()}
        with torch.no_grad():
            w_x = self.w_x.weight.double()
            out["w_h_norm"] = float(self.w_h.weight.float().norm())
            # ||W_x - I||_F^2 = ||W_x||^2 - 2 tr(W_x) + d, without materialising I
            dev2 = float(w_x.pow(2).sum() - 2 * w_x.diagonal().sum()) + self.hidden_size
            out["w_x_dev"] = max(0.0, dev2) ** 0.5
            out["w_g_norm"] = float(self.w_g.weight.float().norm())
            out["gate_bias"] = float(self.w_g.bias.float().mean())
        return out

    def attach(self, layer: nn.Module) -> None:
        """Register this block as ``layer.memory_block`` and hook the layer (see the module docstring)."""
        if hasattr(layer, "memory_block"):
            raise ValueError(f"decoder layer {self.layer_idx} already has a memory_block")
        for name in ("input_layernorm", "self_attn"):
            if not isinstance(getattr(layer, name, None), nn.Module):
                raise TypeError(f"decoder layer {self.layer_idx} has no {name}; not a Llama decoder layer")
        layer.memory_block = self
        self._handles = [
            layer.register_forward_pre_hook(self._layer_pre_hook, with_kwargs=True),
            layer.input_layernorm.register_forward_hook(self._norm_hook),
            layer.self_attn.register_forward_hook(self._attn_hook),
        ]


# -------------------------------------------------------------------------------------------------
# Model-level API


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = getattr(base, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError("expected a LlamaForCausalLM (model.model.layers) or a peft model wrapping one")
    return layers


def memory_blocks(model: nn.Module) -> list[GatedMemoryBlock]:
    """The injected blocks, by layer index."""
    return sorted((m for m in model.modules() if isinstance(m, GatedMemoryBlock)), key=lambda b: b.layer_idx)


def inject_memory(model: nn.Module, position: str = "alma", layers: Optional[Iterable[int]] = None,
                  memory_kwargs: Optional[dict] = None, *, every: int = 2,
                  gate_bias_init: float = THESIS_GATE_BIAS, residual: str = "input",
                  memory_dtype: Optional[torch.dtype] = torch.float32, track_stats: bool = True) -> nn.Module:
    """Insert gated Titans memory blocks into ``model.model.layers`` in place; returns ``model``.

    Args:
        model: a ``transformers.LlamaForCausalLM`` (or a peft model wrapping one).
        position: ``"elma"``, ``"alma"`` or ``"gema"``; picks the default ``layers``.
        layers: 0-based decoder-block indices (overrides ``position``'s default).
        memory_kwargs: keyword arguments of :class:`NeuralMemory` (``dim`` is the hidden size) over the
            thesis's :data:`THESIS_MEMORY`.
        every: GeMA's interval.
        gate_bias_init: b_g at initialisation (thesis: -6).
        residual: ``"input"`` (o = y + x_t, identity at init) or ``"x_dp"`` (eq. 4.10 literally).
        memory_dtype: the blocks' parameter dtype (None: the model's).
    New parameters are trainable; the base model's ``requires_grad`` flags are left as they are. Each new
    block takes its decoder layer's train / eval mode (an eval-mode model keeps its memory across
    ``generate``'s decoding steps, module docstring).
    """
    if position not in POSITIONS:
        raise ValueError(f"unknown position {position!r}; expected one of {', '.join(POSITIONS)}")
    dec = _decoder_layers(model)
    n = len(dec)
    idx = default_layers(position, n, every) if layers is None else [int(i) for i in layers]
    if not idx:
        raise ValueError("no layers to inject memory into")
    if len(set(idx)) != len(idx) or any(not 0 <= i < n for i in idx):
        raise ValueError(f"layers must be distinct indices in [0, {n}); got {idx}")
    ref = next(dec[idx[0]].parameters())
    hidden = getattr(getattr(model, "config", None), "hidden_size", None) or ref.shape[-1]
    for i in sorted(idx):
        block = GatedMemoryBlock(hidden, i, memory_kwargs, gate_bias_init, residual, track_stats)
        block.to(device=ref.device, dtype=memory_dtype or ref.dtype)
        block.train(dec[i].training)
        block.attach(dec[i])
    return model


def set_memory_mode(model: nn.Module, mode: str) -> None:
    """``"auto"`` (default), ``"stream"`` or ``"per_forward"`` for every block (module docstring)."""
    if mode not in MODES:
        raise ValueError(f"unknown memory mode {mode!r}; expected one of {', '.join(MODES)}")
    for b in memory_blocks(model):
        b.mode = mode
        b.reset_memory()


def reset_memory(model: nn.Module) -> None:
    """Reset every block's memory to M_0 (learnable initial weights), zero momentum, empty conv cache.

    Needed between samples only in ``"stream"`` mode; ``"auto"`` resets at every new sequence.
    """
    for b in memory_blocks(model):
        b.reset_memory()


def _is_lora(name: str) -> bool:
    return "lora_" in name


def _no_decay(block: GatedMemoryBlock, name: str, p: torch.Tensor) -> bool:
    # biases and gains, and W_x: decaying the identity-initialised W_x pulls x_DP towards 0, i.e.
    # shrinks every input of the pre-trained attention (a slow drift away from the base model)
    return p.ndim < 2 or name.endswith("out_norm") or p is block.w_x.weight


def param_groups(model: nn.Module, memory_lr: float, lora_lr: float, weight_decay: float,
                 other_lr: Optional[float] = None) -> list[dict]:
    """Optimizer parameter groups: memory blocks at ``memory_lr``, LoRA adapters at ``lora_lr``.

    Groups (empty ones left out), each ``{"name", "params", "lr", "weight_decay"}``: ``memory``,
    ``memory_no_decay`` (biases, gains, W_x), ``lora``, ``lora_no_decay`` (1-D LoRA params, e.g.
    DoRA magnitudes). Frozen parameters are excluded. Any other trainable parameter goes to
    ``other`` at ``other_lr``; with ``other_lr=None`` that is an error (no silent learning rate).
    """
    seen: set[int] = set()
    groups: dict[str, list] = {"memory": [], "memory_no_decay": [], "lora": [], "lora_no_decay": [], "other": []}
    for b in memory_blocks(model):
        for name, p in b.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                groups["memory_no_decay" if _no_decay(b, name, p) else "memory"].append(p)
    other_names = []
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if _is_lora(name):
            groups["lora_no_decay" if p.ndim < 2 else "lora"].append(p)
        else:
            groups["other"].append(p)
            other_names.append(name)
    if other_names and other_lr is None:
        raise ValueError(f"trainable parameters that are neither memory nor LoRA: {other_names[:5]}"
                         f"{' ...' if len(other_names) > 5 else ''}; freeze them or pass other_lr")
    lrs = {"memory": memory_lr, "memory_no_decay": memory_lr, "lora": lora_lr, "lora_no_decay": lora_lr,
           "other": other_lr}
    return [{"name": k, "params": v, "lr": lrs[k], "weight_decay": 0.0 if k.endswith("no_decay") else weight_decay}
            for k, v in groups.items() if v]


def gate_stats(model: nn.Module) -> dict[str, float]:
    """TensorBoard scalars ``memory_module/layer{i}/<stat>`` and ``memory_module/all/<stat>``.

    Stats (Section 4.2.2) of the last forward (over all tokens and channels of the batch):
    ``gate_mean/std/min/max`` of ``g = sigmoid(a W_g + b_g)``; ``contribution`` =
    ||g*m|| / (||(1-g)*a|| + eps) (eq. 4.12); ``contribution_per_token`` (eq. 4.13, mean over tokens
    of the per-token ratio); ``residual_ratio`` = ||g*m|| / ||x_t|| (memory term vs the residual
    stream); and current weights: ``w_h_norm`` = ||W_h||_F, ``w_x_dev`` = ||W_x - I||_F,
    ``w_g_norm`` = ||W_g||_F, ``gate_bias`` = mean(b_g). ``all``: the mean over layers, except
    ``gate_min`` (min over layers) and ``gate_max`` (max). Calling it synchronises with the device.
    """
    out: dict[str, float] = {}
    per: dict[str, list[float]] = {}
    for b in memory_blocks(model):
        for k, v in b.stats().items():
            out[f"{STAT_PREFIX}/layer{b.layer_idx}/{k}"] = v
            per.setdefault(k, []).append(v)
    for k, vs in per.items():
        agg = min(vs) if k == "gate_min" else max(vs) if k == "gate_max" else sum(vs) / len(vs)
        out[f"{STAT_PREFIX}/all/{k}"] = agg
    return out


def _dtype_kwarg(dtype: Union[str, torch.dtype, None]) -> dict:
    import transformers
    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    return {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": dtype}


def load_memory_llama(path_or_hub_id: str, position: str = "alma", layers: Optional[Iterable[int]] = None,
                      memory_kwargs: Optional[dict] = None, lora: Optional[dict] = None, freeze_lora: bool = False,
                      torch_dtype: Union[str, torch.dtype] = torch.float32, *, every: int = 2,
                      gate_bias_init: float = THESIS_GATE_BIAS, residual: str = "input",
                      memory_dtype: Optional[torch.dtype] = torch.float32, track_stats: bool = True) -> nn.Module:
    """A pre-trained Llama with frozen weights, optional LoRA (``peft``) and injected memory.

    Loads ``LlamaForCausalLM.from_pretrained(path_or_hub_id, local_files_only=True)`` (a local
    directory, or a hub id already in the local Hugging Face cache), freezes every base parameter,
    applies LoRA when ``lora`` is given (a dict of ``peft.LoraConfig`` arguments; missing keys take
    the thesis's values :data:`THESIS_LORA`: r=16, alpha=32, dropout=0.05, all attention and MLP
    projections), optionally freezes the LoRA adapters (``freeze_lora``, the thesis's "- LoRA"
    ablation), then injects the memory (:func:`inject_memory`, after LoRA so LoRA never wraps the
    memory's layers). Returns the ``LlamaForCausalLM``, or the ``peft.PeftModel`` wrapping it.

    Gradient checkpointing: the embeddings are frozen, so use
    ``model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})``
    (the reentrant variant gives no gradients to checkpointed layers whose inputs need none).
    """
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path_or_hub_id, local_files_only=True, **_dtype_kwarg(torch_dtype))
    return augment(model, position, layers, memory_kwargs, lora, freeze_lora, every=every,
                   gate_bias_init=gate_bias_init, residual=residual, memory_dtype=memory_dtype,
                   track_stats=track_stats)


def augment(model: nn.Module, position: str = "alma", layers: Optional[Iterable[int]] = None,
            memory_kwargs: Optional[dict] = None, lora: Optional[dict] = None, freeze_lora: bool = False, *,
            every: int = 2, gate_bias_init: float = THESIS_GATE_BIAS, residual: str = "input",
            memory_dtype: Optional[torch.dtype] = torch.float32, track_stats: bool = True) -> nn.Module:
    """:func:`load_memory_llama` on an already loaded ``LlamaForCausalLM``: freeze every base parameter,
    apply LoRA (``lora``: ``peft.LoraConfig`` arguments over :data:`THESIS_LORA`; None: no LoRA),
    optionally freeze it, inject the memory. Returns the model or the ``peft.PeftModel`` wrapping it, in the
    train / eval mode ``model`` was in (``from_pretrained``: eval)."""
    training = model.training
    model.requires_grad_(False)
    if lora is not None:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError as e:  # pragma: no cover - peft is a dependency
            raise ImportError("lora= needs the 'peft' package") from e
        cfg = {**THESIS_LORA, "task_type": "CAUSAL_LM", **dict(lora)}
        model = get_peft_model(model, LoraConfig(**cfg))
        for name, p in model.named_parameters():
            if _is_lora(name):
                p.requires_grad_(not freeze_lora)
    inject_memory(model, position, layers, memory_kwargs, every=every, gate_bias_init=gate_bias_init,
                  residual=residual, memory_dtype=memory_dtype, track_stats=track_stats)
    return model.train(training)  # peft's wrapper starts in training mode whatever the model's


def num_trainable(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


__all__ = [
    "GatedMemoryBlock", "MODES", "POSITIONS", "RESIDUALS", "THESIS_GATE_BIAS", "THESIS_LORA", "THESIS_MEMORY",
    "augment", "default_layers",
    "gate_stats", "inject_memory", "load_memory_llama", "memory_blocks", "num_trainable", "param_groups",
    "reset_memory", "set_memory_mode",
]
