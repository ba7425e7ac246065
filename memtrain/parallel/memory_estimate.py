"""An estimate of the peak memory per GPU of a recipe on a world size (``memtrain recipe show``).

Model states, per parameter (``N`` all parameters, ``N_t`` the trainable ones, ``W`` the data-parallel
ranks; DeepSpeed as :mod:`memtrain.parallel.engine` configures it):

- fp32: weights 4 N, gradients 4 N_t, optimizer states 8 N_t (AdamW m and v);
- bf16: weights 2 N, gradients 2 N_t, optimizer states 16 N_t (fp32 master weights 4, m and v 8, and
  the fp32 gradients 4 of ``data_types.grad_accum_dtype: fp32``).

ZeRO 1 divides the optimizer states by ``W``, ZeRO 2 also the gradients, ZeRO 3 also the weights.
A hierarchical memory bank lives outside DeepSpeed: replicated, every rank holds all its rows with
fp32 weights, gradients and AdamW moments (16 bytes per bank parameter); sharded, ``1/W`` of the rows
with ``bank_dtype`` weights and 12 more bytes (fp32 gradients and moments); offloaded, none on the GPU.

Activations (``model.type decoder``; per micro-batch of ``B`` sequences of ``T`` tokens, ``a`` bytes per
activation value: 2 in bf16, 4 in fp32; widths ``d`` model, ``q`` = heads x head_dim, ``k`` = kv heads x
head_dim, ``f`` FFN inner). What autograd keeps for backward per token and block:

- ``4d``: the block input (norm 1's), norm 1's output (the q/k/v projections'), norm 2's input and
  output (the FFN projections');
- ``4q + 3k`` with qk-norm (``3q + 2k`` without): the q/k projections (the norms' inputs), the
  rotated q/k and v (attention's inputs), attention's output, and its ``[B, T, q]`` copy (``wo``'s input);
- ``2f`` eagerly: the SwiGLU gate and up projections (``w1 x`` and ``w2 x``; backward recomputes the gate's
  activation and their product, :mod:`memtrain.model.swiglu`); ``3f`` in compiled blocks (``model.compile``, by
  default on CUDA: AOTAutograd's min-cut partitioner keeps the product, ``w3``'s input, too); ``4f`` under ZeRO 3,
  where autograd keeps all four (the activation as well), and with LoRA-FFN memories (not modelled);
- ``4 R_i`` for a layer with ``R_i`` FFN-memory channels (hierarchical FFN memories; LoRA and KV
  memories and cross-attention memory layers are not counted).

A checkpointed block keeps only its input (``d``); in backward one checkpointed block is recomputed at
a time, which adds one block's activations once. After the blocks: ``2d`` (the final norm's input and
the head's input, or with the fused loss the hidden-state gradient it precomputes). Attention: with
``model.attention`` sdpa the dense document mask ``B T^2`` bytes once (shared by the layers); flex
(``auto`` on CUDA) keeps a block mask of negligible size. The loss stage, at the end of the forward:

- full logits: ``(a + 12) V`` bytes per token: the logits, the fp32 log-probabilities cross-entropy
  saves, and two fp32 gradient buffers in backward;
- fused (``train.loss_chunk_tokens`` = c): ``min(c, B T) V (2a + 8)`` bytes (one chunk's logits, their
  fp32 copy and gradient, the gradient's cast) plus the fp32 head-gradient accumulator ``4 V d``.

Activations of ``model.type titans``: traced, not a formula (:mod:`.activation_trace`: one forward on fake
CUDA tensors in the run's precision, the memory's Triton kernels included, every saved tensor counted per
block), then checkpointing, the ``2d`` after the blocks and the loss stage as above. What the forward keeps
only: the peaks one H200 measured for the four paper recipes were 17-21% above the estimate (the backward's
working set, README).

Not counted: temporary buffers of single kernels (e.g. attention's workspace), the CUDA context and
allocator fragmentation (typically 1-3 GiB on a GPU), DeepSpeed's communication buckets, and the
math-path attention scores ``[B, H, T, T]`` that sdpa materialises on CPU. The figure is an estimate
for choosing micro-batches and checkpointing, not a guarantee.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from memtrain.config import Recipe, checkpoint_every, compile_enabled

GIB = 2**30


@dataclass
class MemoryEstimate:
    """Bytes per GPU; :attr:`total` their sum. ``notes``: what was assumed or not counted."""

    weights: float
    gradients: float
    optimizer: float
    bank: float
    activations: Optional[float]  # the blocks, the final norm and the attention mask (None: not estimated)
    loss: Optional[float]  # the loss stage (logits or fused chunks)
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        return (self.weights + self.gradients + self.optimizer + self.bank + (self.activations or 0.0)
                + (self.loss or 0.0))


def block_values_per_token(d: int, q: int, k: int, f: int, qk_norm: bool, memory_rank: int = 0,
                           ffn_kept: int = 2) -> int:
    """Activation values autograd keeps per token for one plain (not checkpointed) block (module
    docstring); ``ffn_kept`` of the SwiGLU's four ``[f]`` tensors (:func:`ffn_values_kept`)."""
    attn = 4 * q + 3 * k if qk_norm else 3 * q + 2 * k
    return 4 * d + attn + ffn_kept * f + 4 * memory_rank


def ffn_values_kept(recipe: Recipe) -> int:
    """How many of the SwiGLU's four ``[tokens, ffn_dim]`` tensors a CUDA run of ``recipe`` keeps for backward
    (module docstring): 4 under ZeRO 3, 3 in compiled blocks, 2 eagerly."""
    if recipe.parallel.zero_stage == 3:
        return 4
    return 3 if compile_enabled(recipe, "cuda") else 2


def model_state_bytes(n_params: int, n_trainable: int, precision: str, zero_stage: int,
                      world_size: int) -> tuple[float, float, float]:
    """``(weights, gradients, optimizer states)`` in bytes per GPU (module docstring's table)."""
    w = world_size
    if precision == "bf16":
        weights, grads, opt = 2.0 * n_params, 2.0 * n_trainable, 16.0 * n_trainable
    else:
        weights, grads, opt = 4.0 * n_params, 4.0 * n_trainable, 8.0 * n_trainable
    if zero_stage >= 1:
        opt /= w
    if zero_stage >= 2:
        grads /= w
    if zero_stage >= 3:
        weights /= w
    return weights, grads, opt


def activation_bytes(recipe: Recipe, precision: str, memory_ranks: Optional[list[int]] = None) -> tuple[float, float, str]:
    """``(activations, loss stage, description)`` in bytes for one micro-batch of a decoder recipe."""
    m = recipe.model
    a = 2 if precision == "bf16" else 4
    B, T = recipe.train.micro_batch_size, recipe.data.seq_len
    tokens = B * T
    hd = m.head_dim or m.d_model // m.n_heads
    q, k = m.n_heads * hd, (m.n_kv_heads or m.n_heads) * hd
    ranks = memory_ranks or [0] * m.n_layers
    kept = ffn_values_kept(recipe)
    per_block = [block_values_per_token(m.d_model, q, k, m.ffn_dim, m.qk_norm, r, kept) for r in ranks]
    every = checkpoint_every(recipe.parallel.activation_checkpointing)
    checkpointed = set(range(0, m.n_layers, every)) if every else set()
    values = sum(m.d_model if i in checkpointed else v for i, v in enumerate(per_block))
    if checkpointed:
        values += max(per_block[i] for i in checkpointed)  # the one block recomputed at a time in backward
    values += 2 * m.d_model
    acts = float(values * tokens * a)
    attention = "flex" if m.attention in ("auto", "flex") else "sdpa"
    if attention == "sdpa":
        acts += float(B * T * T)  # the dense document mask, bool
    loss, loss_text = loss_stage_bytes(recipe, a)
    ckpt = _checkpointing_text(every, len(checkpointed), m.n_layers)
    return acts, loss, f"micro-batch {B} x {T}, {ckpt}, {attention} attention, SwiGLU keeps {kept} of 4, {loss_text}"


def loss_stage_bytes(recipe: Recipe, a: int) -> tuple[float, str]:
    """The loss stage's bytes (module docstring) with ``a`` bytes per activation value, and its description."""
    V, d, chunk = recipe.model.vocab_size, recipe.model.d_model, recipe.train.loss_chunk_tokens
    tokens = recipe.train.micro_batch_size * recipe.data.seq_len
    if chunk:
        return float(min(chunk, tokens) * V * (2 * a + 8) + 4 * V * d), f"fused loss in chunks of {chunk} tokens"
    return float(tokens * V * (a + 12)), "full logits"


def _checkpointing_text(every: int, checkpointed: int, n_layers: int) -> str:
    return ("no checkpointing" if not every else "every block checkpointed" if every == 1 else
            f"1 in {every} blocks checkpointed ({checkpointed} of {n_layers})")


def traced_activation_bytes(recipe: Recipe, precision: str) -> tuple[float, float, str]:
    """``(activations, loss stage, description)`` in bytes for one micro-batch of any model whose forward runs
    on the meta device: the blocks' saved tensors traced on fake CUDA tensors
    (:func:`memtrain.parallel.activation_trace.trace_saved_activations`), checkpointing applied per block as
    for the decoder, plus ``2d`` per token after the blocks and the decoder's loss stage (the same LM head)."""
    from memtrain.parallel.activation_trace import checkpointed_bytes, trace_saved_activations

    m = recipe.model
    a = 2 if precision == "bf16" else 4
    tokens = recipe.train.micro_batch_size * recipe.data.seq_len
    traced = trace_saved_activations(recipe, precision)
    every = checkpoint_every(recipe.parallel.activation_checkpointing)
    blocks, checkpointed = checkpointed_bytes(traced.blocks, float(tokens * m.d_model * a), every)
    acts = blocks + float(2 * m.d_model * tokens * a)
    loss, loss_text = loss_stage_bytes(recipe, a)
    ckpt = _checkpointing_text(every, checkpointed or 0, m.n_layers)
    return acts, loss, (f"micro-batch {recipe.train.micro_batch_size} x {recipe.data.seq_len}, {ckpt}, "
                        f"activations traced on CUDA (attention as the fused kernels keep it), {loss_text}")


def _trainable(model, recipe: Recipe) -> int:
    if recipe.memory.freeze_anchor and hasattr(model, "memory_parameters"):
        return sum(p.numel() for p in model.memory_parameters())
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def estimate_peak_memory(recipe: Recipe, world_size: int, precision: str, model) -> MemoryEstimate:
    """Peak memory per GPU for ``recipe`` on ``world_size`` data-parallel ranks in ``precision`` (``bf16``
    or ``fp32``), ``model`` as :func:`memtrain.model.build` returns it (the meta device will do)."""
    n_params = sum(p.numel() for p in model.parameters())
    weights, grads, opt = model_state_bytes(n_params, _trainable(model, recipe), precision,
                                            recipe.parallel.zero_stage, world_size)
    notes = []
    bank = 0.0
    layout = getattr(model, "memory_layout", None)
    mem = recipe.memory
    if layout is not None and mem.enabled:
        if mem.bank == "sharded":
            bank = 0.0 if mem.bank_offload else layout.bank_parameters * ((2 if mem.bank_dtype == "bf16" else 4) + 12) / world_size
            notes.append("bank: sharded" + (", offloaded to CPU" if mem.bank_offload else f" over {world_size} rank(s)"))
        else:
            bank = 16.0 * layout.bank_parameters
            notes.append("bank: replicated on every rank")
    acts = loss = None
    if recipe.model.type == "decoder":
        ranks = None
        if layout is not None and mem.type == "ffn":
            ranks = [layout.layer_rank(i) for i in range(recipe.model.n_layers)]
        elif layout is not None or mem.is_crossattn:
            notes.append("memory layers' activations not counted")
        acts, loss, text = activation_bytes(recipe, precision, ranks)
        notes.insert(0, text)
    elif recipe.model.type == "titans":
        try:
            acts, loss, text = traced_activation_bytes(recipe, precision)
        except Exception as e:  # an estimate: say why it is missing rather than fail recipe show
            text = f"activations not estimated: the trace failed ({type(e).__name__}: {str(e).splitlines()[0]})"
        notes.insert(0, text)
    else:
        notes.insert(0, f"activations not estimated for model.type {recipe.model.type}")
    return MemoryEstimate(weights, grads, opt, bank, acts, loss, notes)


def format_memory_estimate(est: MemoryEstimate, world_size: int, precision: str, zero_stage: int) -> list[str]:
    """The lines `memtrain recipe show` prints."""
    def gib(x: Optional[float]) -> str:
        return "n/a" if x is None else f"{x / GIB:.2f}"

    parts = [f"weights {gib(est.weights)}", f"gradients {gib(est.gradients)}", f"optimizer {gib(est.optimizer)}"]
    if est.bank:
        parts.append(f"bank {gib(est.bank)}")
    parts += [f"activations {gib(est.activations)}", f"loss {gib(est.loss)}"]
    return [f"peak memory per GPU (estimate; {world_size} rank(s), {precision}, ZeRO {zero_stage}): "
            f"{gib(est.total)} GiB = " + " + ".join(parts) + " GiB",
            "  (" + "; ".join(est.notes) + "; formula: memtrain.parallel.memory_estimate)"]


__all__ = ["MemoryEstimate", "activation_bytes", "block_values_per_token", "estimate_peak_memory",
           "format_memory_estimate", "loss_stage_bytes", "model_state_bytes", "traced_activation_bytes"]
