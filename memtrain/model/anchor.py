"""The anchor model: the OpenLM decoder-only transformer of the hierarchical-memories paper.

Architecture (paper Appendix A.1, Tables 6-8, block of Fig. 13; Appendix I names the linear layers):

- token embedding ``V x d``; pre-norm blocks ``x = x + attn(norm1(x))``, ``x = x + ffn(norm2(x))``;
  a final norm; an LM head tied to the embedding (160M) or a separate bias-free linear (410M, 1B).
- attention: bias-free ``wq`` (d -> h*dh), ``wk``/``wv`` (d -> kv*dh, grouped-query when
  kv < h), ``wo`` (h*dh -> d). The attention width h*dh may differ from d (160M: 12 x 32 = 384, d 512).
- qk-norm: one norm over the full projection width (h*dh for queries, kv*dh for keys), before RoPE.
  This is OpenLM's layout, and with it the parameter counts equal the paper's exactly
  (163,510,016 / 411,665,408 / 1,439,893,504).
- norms: ``layernorm`` is gain-only LayerNorm (mean-subtracting, no bias); ``rmsnorm`` is RMSNorm.
- RoPE (Appendix A: frequency base 100,000), rotate-half convention, computed in fp32. With
  ``reset_positions`` the positions restart at every document of a packed sequence.
- SwiGLU FFN with OpenLM's names: ``w3(silu(w1 x) * w2 x)`` (w1 gate, w2 up, w3 down). No biases.
- Attention is causal and never crosses documents (:mod:`memtrain.model.attention`); with
  ``model.attention_window`` it is sliding-window attention (Titans Section 5.2's SWA baseline).

Initialisation (OpenLM's scheme; :meth:`DecoderLM.reset_parameters`): every weight matrix and the
embedding draw from a normal truncated at +-3 sigma, with

- sigma = ``init_std`` or ``1/sqrt(d_model)`` for the embedding, ``wq``, ``wk``, ``wv``, ``w1``,
  ``w2`` and a separate LM head (all have fan-in d_model);
- sigma = ``1/sqrt(fan_in) / sqrt(2 * (layer_index + 1))`` for the output projections ``wo``
  (fan-in h*dh) and ``w3`` (fan-in ffn_dim): depth-scaled so deeper residual branches start smaller;
- norm gains 1.

Construction draws from torch's global RNG only, so ``torch.manual_seed(s); build(cfg)`` is
reproducible. On the meta device no initialisation happens (parameter counting only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from memtrain.config import MemoryConfig, ModelConfig
from memtrain.model import switches
from memtrain.model.attention import AttentionMask, attend, build_attention_mask
from memtrain.model.loss import IGNORE_INDEX, linear_cross_entropy
from memtrain.model.hierarchical import (AnchorDims, FetchedMemory, GenericMemory, MemoryLayout, ffn_memory,
                                         kv_memory, lora_delta)
from memtrain.model.swiglu import silu_mul_linear


@dataclass
class ModelOutput:
    """What a forward returns: logits ``[B, T, V]`` and an optional auxiliary loss (memory modules).
    With ``labels`` passed to the forward, ``loss_sum`` is the summed token cross-entropy (fp32, ignored
    labels not scored: the trainer's ``token_loss_sum``); ``logits`` is then None when the fused loss
    computed it without them (:func:`memtrain.model.loss.linear_cross_entropy`)."""

    logits: Optional[torch.Tensor]
    aux_loss: Optional[torch.Tensor] = None
    loss_sum: Optional[torch.Tensor] = None


# --------------------------------------------------------------------------------------------------
# Document structure of packed sequences


def position_ids_from_doc_ids(doc_ids: torch.Tensor) -> torch.Tensor:
    """Position of each token within its document (0 at every document start). ``[..., T]``."""
    T = doc_ids.shape[-1]
    idx = torch.arange(T, device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[..., 1:] = doc_ids[..., 1:] != doc_ids[..., :-1]
    # The running max of start indices is the start of the current document.
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(-1).values
    return idx - first


# --------------------------------------------------------------------------------------------------
# Building blocks


class RMSNorm(nn.Module):
    """RMSNorm with a gain, computed in at least fp32 (as Llama does) so bf16 inputs keep their scale.

    Where input and gain share a dtype (bf16 training, fp32, float64) it is ``F.rms_norm``, which torch (2.11
    and later) runs on CUDA as one fused kernel forward and one backward (``aten::_fused_rms_norm``), where the
    formula below is 9 kernels forward and about 15 backward; eager ``titans-170m-mac`` normalises over 200
    times per micro-batch. On CPU ``F.rms_norm`` is that formula (bitwise equal in fp32 / float64,
    tests/test_model.py); in bf16 it applies the gain before the one rounding to bf16 (Llama's formula rounds,
    then multiplies)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``weight``: the gain to use instead of the module's (an alias of it, e.g. from
        :func:`memtrain.model.grouped_linear.fan_out`)."""
        weight = self.weight if weight is None else weight
        if x.dtype == weight.dtype:
            return F.rms_norm(x, (x.shape[-1],), weight, self.eps)
        xf = x.to(torch.promote_types(x.dtype, torch.float32))  # mixed dtypes (F.rms_norm would warn)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * weight


def make_norm(kind: str, dim: int, eps: float) -> nn.Module:
    """``layernorm``: gain-only LayerNorm (OpenLM has no biases anywhere); ``rmsnorm``: RMSNorm."""
    if kind == "layernorm":
        return nn.LayerNorm(dim, eps=eps, bias=False)
    if kind == "rmsnorm":
        return RMSNorm(dim, eps=eps)
    raise ValueError(f"unknown norm {kind!r}; expected 'layernorm' or 'rmsnorm'")


class RotaryEmbedding(nn.Module):
    """cos/sin tables of RoPE for given positions, in fp32.

    Holds no buffers: the inverse frequencies are recomputed per forward (head_dim/2 values), so a
    bf16 cast of the model cannot degrade them and state dicts contain parameters only. Tests hook
    this module to see which positions the model used.
    """

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, T]`` positions -> cos, sin of shape ``[B, T, 1, head_dim]`` (broadcast over heads)."""
        device = position_ids.device
        exponent = torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32) / self.head_dim
        inv_freq = 1.0 / (self.theta ** exponent)
        freqs = position_ids.float()[..., None] * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)[..., None, :]
        return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


FUSED_ROPE_ENV = switches.FUSED_ROPE
FUSED_ROPE_DEVICES = ("cuda",)  # where the fused kernel runs (tests add "cpu" under TRITON_INTERPRET=1)


def fused_rope_applies(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether :func:`apply_rope` runs :func:`memtrain.kernels.rope.rope` (one Triton kernel each way) for these
    tensors: on a GPU, eagerly (a compiled graph fuses the formula itself), float32 / half-precision ``x`` and
    float32 tables without gradient, unless ``MEMTRAIN_FUSED_ROPE=0``."""
    return (x.device.type in FUSED_ROPE_DEVICES and x.dim() == 4 and x.shape[-1] % 2 == 0
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and cos.dtype == sin.dtype == torch.float32 and not (cos.requires_grad or sin.requires_grad)
            and not torch.compiler.is_compiling() and switches.flag(FUSED_ROPE_ENV))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, T, H, D]`` by RoPE (rotate-half convention) in fp32 (float64 inputs stay
    float64); returns x's dtype. Eagerly on a GPU as one fused kernel each way (:func:`fused_rope_applies`;
    7 device ops each way in this form)."""
    if fused_rope_applies(x, cos, sin):
        from memtrain.kernels.rope import rope

        return rope(x, cos, sin)
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xf * cos + _rotate_half(xf) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads or cfg.n_heads
        self.head_dim = cfg.head_dim or cfg.d_model // cfg.n_heads
        q_width, kv_width = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.wq = nn.Linear(cfg.d_model, q_width, bias=False)
        self.wk = nn.Linear(cfg.d_model, kv_width, bias=False)
        self.wv = nn.Linear(cfg.d_model, kv_width, bias=False)
        self.wo = nn.Linear(q_width, cfg.d_model, bias=False)
        if cfg.qk_norm:
            self.q_norm = make_norm(cfg.norm, q_width, cfg.norm_eps)
            self.k_norm = make_norm(cfg.norm, kv_width, cfg.norm_eps)
        else:
            self.q_norm = self.k_norm = nn.Identity()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: AttentionMask,
                mem: Optional[torch.Tensor] = None, layout: Any = None) -> torch.Tensor:
        """``mem [B, R, unit]``: this layer's fetched memory when ``layout`` is a LoRA-QK/VO or KV
        memory (:mod:`memtrain.model.hierarchical`)."""
        B, T, _ = x.shape
        kind = _memory_kind(mem, layout)
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        if kind == "lora_qk":
            q = q + lora_delta(x, mem, layout, "q")
            k = k + lora_delta(x, mem, layout, "k")
        elif kind == "lora_vo":
            v = v + lora_delta(x, mem, layout, "v")
        q = self.q_norm(q).view(B, T, self.n_heads, self.head_dim)
        k = self.k_norm(k).view(B, T, self.n_kv_heads, self.head_dim)
        v = v.view(B, T, self.n_kv_heads, self.head_dim)
        q_unrotated = q
        # Under autocast the norms return fp32 while v is bf16; attention wants one dtype.
        q = apply_rope(q, cos, sin).to(v.dtype)
        k = apply_rope(k, cos, sin).to(v.dtype)
        out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        if kind == "kv":  # learned keys/values: no causal mask, no positional encoding (Appendix I)
            out = out + kv_memory(q_unrotated.to(v.dtype).transpose(1, 2), mem, layout)
        out = out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        if kind == "lora_vo":
            return self.wo(out) + lora_delta(out, mem, layout, "o")
        return self.wo(out)


class SwiGLU(nn.Module):
    """SwiGLU FFN (Shazeer 2020) with OpenLM's names: w1 gate, w2 up, w3 down (paper Fig. 13, 18)."""

    def __init__(self, d_model: int, ffn_dim: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, ffn_dim, bias=False)
        self.w2 = nn.Linear(d_model, ffn_dim, bias=False)
        self.w3 = nn.Linear(ffn_dim, d_model, bias=False)

    def forward(self, x: torch.Tensor, mem: Optional[torch.Tensor] = None, layout: Any = None) -> torch.Tensor:
        """``mem [B, R, unit]``: this layer's fetched FFN or LoRA-FFN memory."""
        kind = _memory_kind(mem, layout)
        if kind == "lora_ffn":
            h = F.silu(self.w1(x) + lora_delta(x, mem, layout, "w1")) * (self.w2(x) + lora_delta(x, mem, layout, "w2"))
            return self.w3(h) + lora_delta(h, mem, layout, "w3")
        out = silu_mul_linear(self.w1(x), self.w2(x), self.w3.weight)  # keeps w1 x and w2 x (memtrain.model.swiglu)
        if kind == "ffn":  # the fetched channels widen the inner dimension (Appendix I, Fig. 18)
            out = out + ffn_memory(x, mem, layout)
        return out


def _memory_kind(mem: Optional[torch.Tensor], layout: Any) -> Optional[str]:
    if mem is None or layout is None:
        return None
    return f"lora_{layout.lora_target}" if layout.kind == "lora" else layout.kind


class Block(nn.Module):
    """Pre-norm transformer block of Fig. 13."""

    def __init__(self, cfg: ModelConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.norm1 = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, layer_index)
        self.norm2 = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
        self.ffn = SwiGLU(cfg.d_model, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: AttentionMask,
                mem: Optional[torch.Tensor] = None, layout: Any = None, memory_read: Any = None,
                memory_after: str = "attn") -> torch.Tensor:
        """``memory_read(x) -> x``: a cross-attention memory layer (:mod:`memtrain.model.crossattn`) read
        after the self-attention (variant A, ``memory_after="attn"``) or after the MLP (variant B)."""
        ffn_mem = layout is not None and mem is not None and _memory_kind(mem, layout) in ("ffn", "lora_ffn")
        x = x + self.attn(self.norm1(x), cos, sin, mask, *((None, None) if ffn_mem else (mem, layout)))
        if memory_read is not None and memory_after == "attn":
            x = memory_read(x)
        x = x + self.ffn(self.norm2(x), *((mem, layout) if ffn_mem else (None, None)))
        if memory_read is not None and memory_after == "ffn":
            x = memory_read(x)
        return x


class LMHead(nn.Linear):
    """The bias-free LM head (state-dict key ``lm_head.weight``, possibly tied to the embedding). Called
    with ``labels`` it returns the summed token loss instead of the logits: the fused, chunked
    linear + cross-entropy when ``chunk_tokens`` > 0. The loss runs inside this module's own call so that
    ZeRO-3 gathers the weight around it, as for the plain logits."""

    def forward(self, x: torch.Tensor, labels: Optional[torch.Tensor] = None, chunk_tokens: int = 0):
        if labels is None:
            return F.linear(x, self.weight)
        if chunk_tokens > 0:
            return None, linear_cross_entropy(x, self.weight, labels, chunk_tokens=chunk_tokens)
        logits = F.linear(x, self.weight)
        upcast = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 (float64 stays float64)
        return logits, F.cross_entropy(upcast.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                       ignore_index=IGNORE_INDEX, reduction="sum")


def lm_output(model: nn.Module, x: torch.Tensor, labels: Optional[torch.Tensor]) -> tuple[Any, Any]:
    """``(logits, loss_sum)`` of the final hidden states ``x`` (before the final norm): logits alone
    without ``labels``; with them the summed loss, and the logits unless the fused loss is on."""
    h = model.norm(x)
    if labels is None:
        return model.lm_head(h), None
    if labels.shape != x.shape[:-1]:
        raise ValueError(f"labels shape {tuple(labels.shape)} differs from input_ids {tuple(x.shape[:-1])}")
    return model.lm_head(h, labels, model.loss_chunk_tokens)


def checkpoint_interval(every: Any) -> int:
    """Activation checkpointing as a block interval: 0 none, 1 every block, n every n-th block (blocks
    0, n, 2n, ...). ``True``/``False`` are every/none."""
    if isinstance(every, bool):
        return int(every)
    if not isinstance(every, int) or every < 0:
        raise ValueError(f"activation checkpointing must be true, false or a block interval >= 0, got {every!r}")
    return every


def checkpointed_blocks(n_layers: int, every: int) -> list[int]:
    """The indices of the blocks recomputed in backward under :func:`checkpoint_interval` ``every``."""
    return list(range(0, n_layers, every)) if every else []


def _trunc_normal_(weight: torch.Tensor, std: float) -> None:
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


# --------------------------------------------------------------------------------------------------
# The model


def build_lm_shell(model: nn.Module, cfg: ModelConfig, blocks: nn.ModuleList) -> None:
    """Give ``model`` what every decoder LM here shares around its ``blocks``: ``embed``, the final
    ``norm``, ``lm_head`` (tied or separate), ``rope``, ``head_dim`` and the checkpointing flag."""
    model.head_dim = cfg.head_dim or cfg.d_model // cfg.n_heads
    model.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
    model.blocks = blocks
    model.norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps)
    if cfg.tie_embeddings:
        # Built on meta so that no V x d matrix is allocated only to be replaced by the embedding.
        model.lm_head = LMHead(cfg.d_model, cfg.vocab_size, bias=False, device="meta")
        model.lm_head.weight = model.embed.weight
    else:
        model.lm_head = LMHead(cfg.d_model, cfg.vocab_size, bias=False)
    model.rope = RotaryEmbedding(model.head_dim, cfg.rope_theta)
    model.activation_checkpointing = 0  # block interval (checkpoint_interval)
    model.loss_chunk_tokens = 0  # with labels: 0 the logits' cross-entropy, > 0 the fused loss in such chunks


class TrainingOptions:
    """What the trainer switches on in a decoder LM built by :func:`build_lm_shell` (mixed into
    :class:`DecoderLM` and :class:`memtrain.model.titans.arch.TitansLM`)."""

    def set_activation_checkpointing(self, every: Any) -> None:
        """Recompute blocks' activations in backward (training only) to save memory: ``True`` every block,
        ``False``/0 none, an int n every n-th block (0, n, 2n, ...)."""
        self.activation_checkpointing = checkpoint_interval(every)

    def set_fused_loss(self, chunk_tokens: int) -> None:
        """With ``labels``, compute the loss ``chunk_tokens`` tokens at a time without the logits (0: off)."""
        if chunk_tokens < 0:
            raise ValueError(f"chunk_tokens must be >= 0, got {chunk_tokens}")
        self.loss_chunk_tokens = int(chunk_tokens)

    def _recompute(self, index: int) -> bool:
        every = self.activation_checkpointing
        return bool(every) and index % every == 0 and self.training and torch.is_grad_enabled()


class DecoderLM(TrainingOptions, nn.Module):
    """OpenLM decoder-only language model (see the module docstring for architecture and init)."""

    def __init__(self, cfg: ModelConfig, memory: Optional[MemoryConfig] = None, branching: int = 16):
        super().__init__()
        self.cfg = cfg
        build_lm_shell(self, cfg, nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers)))
        self.memory_layout: Optional[MemoryLayout] = None
        self.generic_memory: Optional[GenericMemory] = None
        self.crossattn = None
        self.reset_parameters()
        if memory is not None and memory.enabled:
            self.memory_layout = MemoryLayout.build(memory, anchor_dims(cfg), branching)
            self.generic_memory = GenericMemory(self.memory_layout)
        if memory is not None and memory.is_crossattn:
            from memtrain.model.crossattn import CrossAttnMemory

            self.crossattn = CrossAttnMemory(memory.crossattn, cfg.d_model, cfg.n_heads, self.head_dim, cfg.n_layers,
                                             cfg.ffn_dim, lambda: make_norm(cfg.norm, cfg.d_model, cfg.norm_eps))

    def reset_parameters(self) -> None:
        """OpenLM initialisation (module docstring); a no-op on the meta device."""
        if self.embed.weight.is_meta:
            return
        cfg = self.cfg
        base = cfg.init_std or 1.0 / math.sqrt(cfg.d_model)
        attn_width = cfg.n_heads * self.head_dim
        _trunc_normal_(self.embed.weight, base)
        for block in self.blocks:
            depth = 1.0 / math.sqrt(2 * (block.layer_index + 1))
            attn, ffn = block.attn, block.ffn
            for linear in (attn.wq, attn.wk, attn.wv, ffn.w1, ffn.w2):
                _trunc_normal_(linear.weight, base)
            _trunc_normal_(attn.wo.weight, depth / math.sqrt(attn_width))
            _trunc_normal_(ffn.w3.weight, depth / math.sqrt(cfg.ffn_dim))
        if not cfg.tie_embeddings:
            _trunc_normal_(self.lm_head.weight, base)
        for module in self.modules():
            if isinstance(module, (nn.LayerNorm, RMSNorm)):
                module.reset_parameters()

    def compile_blocks(self, **compile_kwargs: Any) -> int:
        """Regional compilation: ``torch.compile`` each decoder block (``nn.Module.compile``, in place).
        The blocks share one class and one forward, so Dynamo compiles that code once and every block
        reuses it (parameters are graph inputs; tests/test_compile.py counts the frames). Blocks that
        read a cross-attention memory stay eager (their read is a per-layer Python object). Returns how
        many blocks were compiled."""
        n = 0
        for i, block in enumerate(self.blocks):
            if self.crossattn is not None and self.crossattn.has(i):
                continue
            block.compile(**compile_kwargs)
            n += 1
        return n

    def position_ids(self, input_ids: torch.Tensor, doc_ids: Optional[torch.Tensor]) -> torch.Tensor:
        """RoPE positions: per document when ``reset_positions`` and doc_ids are given, else 0..T-1."""
        if doc_ids is not None and self.cfg.reset_positions:
            return position_ids_from_doc_ids(doc_ids)
        return torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(input_ids)

    def anchor_parameters(self) -> list[nn.Parameter]:
        """Every parameter but the memories' (the generic memory, or the cross-attention memory layers)."""
        skip = {id(p) for p in self.memory_parameters() + self.bank_parameters()}
        return [p for p in self.parameters() if id(p) not in skip]

    def memory_parameters(self) -> list[nn.Parameter]:
        """The memory parameter group (memory.optimizer): the generic memory, or the cross-attention
        memory layers' query/output projections, routers and variant-B MLPs (the bank and its W_K, W_V
        are :meth:`bank_parameters`)."""
        if self.generic_memory is not None:
            return list(self.generic_memory.parameters())
        if self.crossattn is not None:
            bank = {id(p) for p in self.crossattn.bank_parameters()}
            return [p for p in self.crossattn.parameters() if id(p) not in bank]
        return []

    def bank_parameters(self) -> list[nn.Parameter]:
        """Cross-attention memory banks and their W_K, W_V (their own group: memory.crossattn.bank_lr,
        freeze_bank_at)."""
        return self.crossattn.bank_parameters() if self.crossattn is not None else []

    def forward(self, input_ids: torch.Tensor, doc_ids: Optional[torch.Tensor] = None,
                memory: Optional[FetchedMemory] = None, labels: Optional[torch.Tensor] = None) -> ModelOutput:
        """``input_ids`` ``[B, T]``; ``doc_ids`` ``[B, T]`` document index per position (computed by the
        loader: :func:`memtrain.data.loader.document_ids`), None for one document per sequence. ``memory``:
        the sequences' fetched memory (from the bank) and generic mask; None runs the anchor alone.
        ``labels`` ``[B, T]``: also return the summed token loss (:class:`ModelOutput`)."""
        if memory is not None and self.memory_layout is None:
            raise ValueError("this model has no memory modules (memory.type is 'none'); pass memory=None")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}")
        T = input_ids.shape[1]
        if T > self.cfg.max_seq_len and self.cfg.attention_window is None:
            # A windowed decoder is length-agnostic: RoPE offsets within a window never exceed it.
            raise ValueError(f"sequence length {T} exceeds model.max_seq_len {self.cfg.max_seq_len}")
        if doc_ids is not None and doc_ids.shape != input_ids.shape:
            raise ValueError(f"doc_ids shape {tuple(doc_ids.shape)} differs from input_ids "
                             f"{tuple(input_ids.shape)}")

        cos, sin = self.rope(self.position_ids(input_ids, doc_ids))
        # Built once per forward (for flex: the block mask) and shared by every block.
        mask = build_attention_mask(doc_ids, T, self.cfg.attention, input_ids.device, self.cfg.attention_window)
        x = self.embed(input_ids)
        layout = self.memory_layout
        mems: list[Optional[torch.Tensor]] = [None] * len(self.blocks)
        if memory is not None:
            mems = layout.per_layer(self.generic_memory(memory, input_ids.shape[0]))
        routing_losses: list[torch.Tensor] = []
        reads: list[_MemoryRead] = []
        # Sequence routing pools each document of a packed row on its own (eq. 8 per document).
        documents = None
        if self.crossattn is not None and self.crossattn.pools_sequence:
            from memtrain.model.crossattn.routing import DocumentSegments
            documents = DocumentSegments.of(doc_ids)
        for i, (block, mem) in enumerate(zip(self.blocks, mems)):
            extra: tuple = (mem, layout) if mem is not None else (None, None)
            kwargs = {}
            if self.crossattn is not None and self.crossattn.has(i):
                reads.append(_MemoryRead(self.crossattn, i, routing_losses, documents))
                kwargs = {"memory_read": reads[-1],
                          "memory_after": "attn" if self.crossattn.cfg.variant == "A" else "ffn"}
            if self._recompute(i):
                x = checkpoint(block, x, cos, sin, mask, *extra, use_reentrant=False, **kwargs)
            else:
                x = block(x, cos, sin, mask, *extra, **kwargs)
        for read in reads:  # a checkpointed block's recomputation in backward reads again: it records nothing
            read.recomputing = True
        aux = None
        if routing_losses and self.crossattn.cfg.balance_loss:
            # Load balancing (Switch-style), averaged over the memory layers; the trainer adds it to the loss.
            aux = self.crossattn.cfg.balance_loss * torch.stack(routing_losses).mean()
        logits, loss_sum = lm_output(self, x, labels)
        return ModelOutput(logits=logits, aux_loss=aux, loss_sum=loss_sum)


class _MemoryRead:
    """Block ``layer``'s cross-attention memory read (``x -> x``), collecting its routing loss and
    statistics in the forward; once ``recomputing`` (set after the forward's blocks have run), a call is
    activation checkpointing's recomputation in backward and records neither."""

    def __init__(self, memory: Any, layer: int, losses: list, documents: Any = None) -> None:
        self.memory, self.layer, self.losses, self.documents = memory, layer, losses, documents
        self.recomputing = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x, loss = self.memory.apply(self.layer, x, self.documents, record=not self.recomputing)
        if loss is not None and not self.recomputing:
            self.losses.append(loss)
        return x


def anchor_dims(cfg: ModelConfig) -> AnchorDims:
    """The widths of a memtrain decoder that a memory layout depends on."""
    head_dim = cfg.head_dim or cfg.d_model // cfg.n_heads
    return AnchorDims(d_model=cfg.d_model, n_layers=cfg.n_layers, q_width=cfg.n_heads * head_dim,
                      kv_width=(cfg.n_kv_heads or cfg.n_heads) * head_dim, ffn_dim=cfg.ffn_dim, head_dim=head_dim,
                      init_std=cfg.init_std or 1.0 / math.sqrt(cfg.d_model))


__all__ = [
    "Attention", "Block", "DecoderLM", "LMHead", "TrainingOptions", "anchor_dims", "ModelOutput", "RMSNorm",
    "RotaryEmbedding", "SwiGLU", "apply_rope", "build_lm_shell", "checkpoint_interval", "checkpointed_blocks",
    "lm_output", "make_norm", "position_ids_from_doc_ids",
]
