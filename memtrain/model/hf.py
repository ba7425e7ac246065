"""Hierarchical FFN memories added post hoc to a pretrained Hugging Face causal LM (``model.type: hf``).

Hierarchical-memories paper (Pouransari et al.): Section 4, "Adding memory to other pretrained models"
(Gemma 3 270M, Qwen 2.5 0.5B, Llama 3.2 1B with FFN memories of about 10% of the model size, anchors
frozen), Appendix A.6 (their set-up: memory configs (512, 128, 32, 0) / (768, 256, 32, 0), the
optimizer of A.2, and "we do not restrict cross-attention because the baseline models were not all
trained this way") and Appendix I, "FFN-Memories" (the fetched memory widens the inner dimension of
the three FFN matrices; 3 r L d parameters per unit of multiplier; W1/W2 parts truncated normal, the
W3 part zero, so a fresh memory has no effect).

:class:`HFMemoryLM` wraps any ``AutoModelForCausalLM`` whose decoder layers have a gated MLP
``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` -- the Llama, Qwen2 and Gemma 3 families (Gemma's
``act_fn`` is tanh-approximated GELU, not SiLU: the memory channels use the MLP's own activation).
The Hugging Face modules and their state-dict keys are untouched: every memory layer's ``mlp`` gets a
forward hook that adds :func:`memtrain.model.hierarchical.ffn_memory` of the MLP's input (batched
per sequence) to the MLP's output. For Gemma 3 that is before ``post_feedforward_layernorm``, i.e.
exactly the widened FFN. The per-layer memories of one call are set by :meth:`HFMemoryLM.forward`
and cleared when it returns (also on exceptions).

Activation checkpointing (:meth:`HFMemoryLM.set_activation_checkpointing`: every layer or every n-th) is
Hugging Face's own, non-reentrant. The memories are closed over by the hooks, not inputs of the checkpointed layers, so
each layer's checkpoint function is wrapped to re-install the memories of its own call when the
layer is recomputed during backward (after ``forward`` has returned).

The interface is :class:`memtrain.model.anchor.DecoderLM`'s: ``memory_layout``, ``generic_memory``,
``anchor_parameters()``, ``memory_parameters()``, ``set_activation_checkpointing(flag)`` and
``forward(input_ids, doc_ids=None, memory=None) -> ModelOutput``. Positions run 0..T-1 over the
whole packed sequence and attention is causal over it (``doc_ids`` is accepted and ignored, A.6).

:class:`MemoryLlamaLM` (``memory.type: memory_llama``) is the same wrapper around a pretrained Llama
with frozen weights, ``peft`` LoRA adapters and the gated Titans memory blocks of the MemoryLlama
thesis (:mod:`memtrain.model.titans.memory_llama`) inside its decoder layers; it has no memory bank.

:class:`CrossAttnAdapterLM` (``memory.type: crossattn``) is the same wrapper around a pretrained Llama,
Qwen2 or Gemma 3 with frozen weights, optional ``peft`` LoRA adapters, and the cross-attention memory
layers of the crossattn-memory-banks paper inserted as memory adapters (Section 5;
:mod:`memtrain.model.crossattn.adapter`).

Imports torch only at module level; transformers is imported when a model is built.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Optional

import torch
from torch import nn

from memtrain.config import CrossAttnConfig, MemoryConfig, MemoryLlamaConfig, ModelConfig, RecipeError
from memtrain.model.anchor import ModelOutput, checkpoint_interval, make_norm
from memtrain.model.hierarchical import AnchorDims, FetchedMemory, GenericMemory, MemoryLayout, ffn_memory

MLP_ATTRS = ("gate_proj", "up_proj", "down_proj", "act_fn")
_KEY = "model.pretrained"


# --------------------------------------------------------------------------------------------------
# Loading


def text_config(config: Any) -> Any:
    """The decoder's config (Gemma 3's multimodal config nests it as ``text_config``)."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def hf_anchor_dims(config: Any) -> AnchorDims:
    """The widths a memory layout depends on, from a Hugging Face config."""
    tc = text_config(config)
    d, heads = tc.hidden_size, tc.num_attention_heads
    head_dim = getattr(tc, "head_dim", None) or d // heads
    kv_heads = getattr(tc, "num_key_value_heads", None) or heads
    return AnchorDims(d_model=d, n_layers=tc.num_hidden_layers, q_width=heads * head_dim,
                      kv_width=kv_heads * head_dim, ffn_dim=tc.intermediate_size, head_dim=head_dim,
                      init_std=getattr(tc, "initializer_range", None) or d ** -0.5)


def _resolve(name: Optional[str]) -> str:
    """A local folder (expanded) or a hub id; RecipeError for paths that do not exist."""
    if not name:
        raise RecipeError(_KEY, "is required with model.type 'hf': a local Hugging Face model folder or a hub id")
    path = os.path.expanduser(str(name))
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise RecipeError(_KEY, f"{name!r} is a file; give the model folder (with config.json and the weights)")
        return path
    looks_like_path = (path.startswith(("/", ".", "~")) or path.endswith("/") or path.count("/") > 1
                       or os.sep != "/" and os.sep in path)
    if looks_like_path:
        raise RecipeError(_KEY, f"path {name!r} does not exist; give a local Hugging Face model folder "
                                "(config.json and weights) or a hub id reachable from this machine")
    return str(name)  # a hub id ("org/name"), resolved by transformers (local cache or the hub)


def _cannot_load(name: str, err: BaseException) -> RecipeError:
    first = (str(err).strip().splitlines() or [""])[0][:300]
    return RecipeError(_KEY, f"{name!r} cannot be loaded ({type(err).__name__}: {first}); give a local Hugging "
                             "Face model folder (config.json and weights) or a hub id reachable from this machine "
                             "(or already in the local Hugging Face cache)")


def _lora_targets_error(key: str, targets: Any, model: str, err: BaseException) -> RecipeError:
    """peft's error for LoRA target modules the model does not have, as one recipe error on ``key``."""
    first = (str(err).strip().splitlines() or [""])[0][:300]
    return RecipeError(key, f"{targets} do not fit {model}: {first}")


def _cached_snapshot(repo_id: str) -> Optional[str]:
    """The folder of hub model ``repo_id``'s snapshot in the local Hugging Face cache, or None (no network)."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, local_files_only=True)
    except Exception:  # not cached (LocalEntryNotFoundError), or not a valid repository id
        return None


def hub_unreachable() -> Optional[str]:
    """Why the Hugging Face hub cannot be reached from here, or None when it may be: ``HF_HUB_OFFLINE`` set, or
    the endpoint's host name does not resolve (offline, or a cluster's compute node without DNS). Answering that
    takes milliseconds; asking the hub itself retried for 27 s here, logging each retry."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    host = urlparse(constants.ENDPOINT).hostname
    if not host:
        return None
    try:
        socket.getaddrinfo(host, 443)
    except OSError as e:
        return f"{host} does not resolve: {e.strerror or e}"
    return None


@contextlib.contextmanager
def _hub_warnings_off() -> Iterator[None]:
    import logging

    hub = logging.getLogger("huggingface_hub")
    level = hub.level
    hub.setLevel(logging.ERROR)
    try:
        yield
    finally:
        hub.setLevel(level)


def load_causal_lm(name: Optional[str]) -> nn.Module:
    """``AutoModelForCausalLM`` in float32 from a folder or hub id. Under ``with torch.device("meta")``
    the model is built from its config alone (no weights read), for parameter counts."""
    from transformers import AutoConfig, AutoModelForCausalLM

    source = _resolve(name)
    meta = torch.get_default_device().type == "meta"

    def fetch(load, **kw):
        if os.path.isdir(source):
            return load(source, **kw)
        # A hub id: its snapshot in the local cache first, loaded as a folder. from_pretrained(local_files_only=True)
        # still asked the hub whether the repository holds a PEFT adapter (AutoModelForCausalLM's adapter lookup
        # does not get the flag), which retried for 27 s offline.
        cached, cached_error = _cached_snapshot(source), None
        if cached is not None:
            try:
                return load(cached, **kw)
            except Exception as e:  # incomplete in the cache (a config without weights, say): from the hub
                cached_error = e
        unreachable = hub_unreachable()
        if unreachable and cached_error is not None:
            raise _cannot_load(str(name), cached_error) from cached_error
        if unreachable:
            raise RecipeError(_KEY, f"{name!r} is not a folder here ({os.path.abspath(source)}) nor in the local "
                                    f"Hugging Face cache, and the hub cannot be reached ({unreachable}); give a "
                                    "local model folder (config.json and weights), or download the model first "
                                    "where the hub can be reached") from None
        with _hub_warnings_off():  # its retries log a line each; the outcome is one recipe error or the model
            return load(source, **kw)

    try:
        if meta:
            return AutoModelForCausalLM.from_config(fetch(AutoConfig.from_pretrained), dtype=torch.float32)
        return fetch(AutoModelForCausalLM.from_pretrained, dtype=torch.float32)
    except RecipeError:
        raise
    except Exception as err:  # OSError (missing files, no network), ValueError (unknown architecture), ...
        raise _cannot_load(str(name), err) from err


def decoder_layers(model: nn.Module, n_layers: int) -> Optional[nn.ModuleList]:
    """The decoder layers of a Hugging Face causal LM (``model.model.layers`` for Llama, Qwen2 and
    Gemma 3; ``model.model.language_model.layers`` for Gemma 3 with vision)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers) == n_layers:
        return layers
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == n_layers and name.rsplit(".", 1)[-1] in (
                "layers", "h", "layer", "blocks"):
            return module
    return None


def check_gated_mlps(model: nn.Module, layers: Optional[nn.ModuleList]) -> None:
    """RecipeError unless every decoder layer has an ``mlp`` with gate_proj, up_proj, down_proj, act_fn."""
    arch = type(model).__name__
    if layers is None:
        raise RecipeError(_KEY, f"{arch}: cannot find its decoder layers; FFN memories attach to Llama, Qwen2 "
                                "and Gemma 3 style models (model.layers[i].mlp)")
    for i, layer in enumerate(layers):
        mlp = getattr(layer, "mlp", None)
        missing = ["mlp"] if mlp is None else [a for a in MLP_ATTRS if not hasattr(mlp, a)]
        if missing:
            what = type(layer).__name__ if mlp is None else f"{type(layer).__name__}.mlp ({type(mlp).__name__})"
            raise RecipeError(_KEY, f"{arch} is not supported: decoder layer {i}'s {what} lacks "
                                    f"{', '.join(missing)}; FFN memories need a gated MLP down_proj(act_fn("
                                    "gate_proj(x)) * up_proj(x)) as in Llama, Qwen2 and Gemma 3")


# --------------------------------------------------------------------------------------------------
# The memories of the current call


class _CallMemory:
    """The per-layer memories ``[B, R_i, unit]`` (or None) the MLP hooks read during one forward."""

    def __init__(self, layout: Optional[MemoryLayout]):
        self.layout = layout
        self.mems: Optional[list[Optional[torch.Tensor]]] = None

    @contextlib.contextmanager
    def using(self, mems: Optional[list[Optional[torch.Tensor]]]) -> Iterator[None]:
        previous, self.mems = self.mems, mems
        try:
            yield
        finally:
            self.mems = previous

    def hook(self, layer_index: int):
        def add_memory(mlp: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor):
            mems = self.mems
            if mems is None or mems[layer_index] is None:
                return None
            x = args[0] if args else next(iter(kwargs.values()))
            return output + ffn_memory(x, mems[layer_index], self.layout, act=mlp.act_fn)
        return add_memory


class _SnapshotCheckpoint:
    """Wraps a layer's ``_gradient_checkpointing_func`` so that the recomputation in backward runs with
    the memories of the forward call it belongs to (they are cleared once ``forward`` returns)."""

    def __init__(self, call: _CallMemory, checkpoint_fn):
        self.call = call
        self.checkpoint_fn = checkpoint_fn

    def __call__(self, function, *args, **kwargs):
        snapshot = self.call.mems

        def run(*a, **k):
            with self.call.using(snapshot):
                return function(*a, **k)

        return self.checkpoint_fn(run, *args, **kwargs)


# --------------------------------------------------------------------------------------------------
# The model


class HFMemoryLM(nn.Module):
    """A pretrained Hugging Face causal LM with hierarchical FFN memories (see the module docstring)."""

    def __init__(self, hf_model: nn.Module, memory_cfg: Optional[MemoryConfig] = None, branching: int = 16,
                 model_cfg: Optional[ModelConfig] = None):
        super().__init__()
        self.cfg = model_cfg
        self.hf_model = hf_model
        self.dims: Optional[AnchorDims] = None  # the widths the memory layout depends on
        self.memory_layout: Optional[MemoryLayout] = None
        self.generic_memory: Optional[GenericMemory] = None
        self.activation_checkpointing = False
        self._hooks: list = []
        if memory_cfg is not None and memory_cfg.enabled:
            if memory_cfg.type != "ffn":
                raise RecipeError("memory.type", f"{memory_cfg.type!r} is not available with model.type 'hf'; "
                                                 "use 'ffn' (the paper's post-hoc memories, Section 4)")
            layers = decoder_layers(hf_model, text_config(hf_model.config).num_hidden_layers)
            check_gated_mlps(hf_model, layers)
            self.dims = hf_anchor_dims(hf_model.config)
            self.memory_layout = MemoryLayout.build(memory_cfg, self.dims, branching)
            self.generic_memory = GenericMemory(self.memory_layout)
        self._call = _CallMemory(self.memory_layout)
        if self.memory_layout is not None:
            for i in self.memory_layout.layers:
                self._hooks.append(layers[i].mlp.register_forward_hook(self._call.hook(i), with_kwargs=True))
        self.train()  # from_pretrained returns eval mode; a fresh module (like DecoderLM) is in train mode

    @classmethod
    def from_config(cls, model_cfg: ModelConfig, memory_cfg: Optional[MemoryConfig] = None,
                    branching: int = 16) -> "HFMemoryLM":
        """Load ``model_cfg.pretrained`` (float32; config only on the meta device) and attach memories
        (``memory.type: memory_llama``: a :class:`MemoryLlamaLM`; ``crossattn``: a :class:`CrossAttnAdapterLM`)."""
        if memory_cfg is not None and memory_cfg.is_memory_llama:
            return MemoryLlamaLM(load_causal_lm(model_cfg.pretrained), memory_cfg, model_cfg)
        if memory_cfg is not None and memory_cfg.is_crossattn:
            return CrossAttnAdapterLM(load_causal_lm(model_cfg.pretrained), memory_cfg, model_cfg)
        return cls(load_causal_lm(model_cfg.pretrained), memory_cfg, branching, model_cfg)

    # -- parameters --------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return int(text_config(self.hf_model.config).vocab_size)

    def anchor_parameters(self) -> list[nn.Parameter]:
        """The Hugging Face model's parameters (a tied embedding and head counted once)."""
        return list(self.hf_model.parameters())

    def memory_parameters(self) -> list[nn.Parameter]:
        return list(self.generic_memory.parameters()) if self.generic_memory is not None else []

    def freeze_anchor(self) -> "HFMemoryLM":
        """Train the memories only (Section 4 / A.6: the open-weight anchors stay frozen)."""
        self.hf_model.requires_grad_(False)
        return self

    # -- activation checkpointing ------------------------------------------------------------------

    def set_activation_checkpointing(self, every: Any) -> None:
        """Hugging Face's non-reentrant gradient checkpointing (training only) of every decoder layer
        (``True`` or 1), every n-th (an int n: layers 0, n, 2n, ...; the others' per-layer
        ``gradient_checkpointing`` flag is cleared) or none (``False`` or 0)."""
        every = checkpoint_interval(every)
        self.activation_checkpointing = every
        if every:
            self.hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self._wrap_checkpoint_functions()
            if every > 1:
                n_layers = text_config(self.hf_model.config).num_hidden_layers
                layers = decoder_layers(self.hf_model, n_layers)
                if layers is None or not all(hasattr(layer, "gradient_checkpointing") for layer in layers):
                    raise ValueError(f"checkpointing every {every}-th layer needs Hugging Face decoder layers with "
                                     "a gradient_checkpointing flag; use true (every layer) for this model")
                for i, layer in enumerate(layers):
                    layer.gradient_checkpointing = i % every == 0
        elif getattr(self.hf_model, "is_gradient_checkpointing", False):
            self.hf_model.gradient_checkpointing_disable()

    def _wrap_checkpoint_functions(self) -> None:
        for module in self.hf_model.modules():
            fn = getattr(module, "_gradient_checkpointing_func", None)
            if fn is not None and not isinstance(fn, _SnapshotCheckpoint):
                module._gradient_checkpointing_func = _SnapshotCheckpoint(self._call, fn)

    # -- forward -----------------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, doc_ids: Optional[torch.Tensor] = None,
                memory: Optional[FetchedMemory] = None) -> ModelOutput:
        """``input_ids [B, T]``; ``doc_ids`` is ignored (attention crosses documents, Appendix A.6);
        ``memory``: the sequences' fetched memory and generic mask, None for the plain model."""
        if memory is not None and self.memory_layout is None:
            raise ValueError("this model has no memory modules (memory.type is 'none'); pass memory=None")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}")
        if doc_ids is not None and doc_ids.shape != input_ids.shape:
            raise ValueError(f"doc_ids shape {tuple(doc_ids.shape)} differs from input_ids {tuple(input_ids.shape)}")
        mems = None
        if memory is not None:
            mems = self.memory_layout.per_layer(self.generic_memory(memory, input_ids.shape[0]))
            # Checkpointing may have been switched on through the Hugging Face API directly.
            self._wrap_checkpoint_functions()
        with self._call.using(mems):
            out = self.hf_model(input_ids=input_ids, use_cache=False, return_dict=True)
        return ModelOutput(logits=out.logits)


# --------------------------------------------------------------------------------------------------
# MemoryLlama: Titans memories inside the model (memory.type memory_llama)


def memory_llama_kwargs(ml: MemoryLlamaConfig) -> dict:
    """:class:`memtrain.model.titans.NeuralMemory` arguments from ``memory.memory_llama``."""
    return {"heads": ml.heads, "head_dim": ml.head_dim, "depth": ml.depth, "expansion": ml.expansion,
            "chunk_size": ml.chunk_size, "gate_mode": ml.gate_mode, "conv_kernel": ml.conv_kernel,
            "max_lr": ml.max_lr, "init_lr": ml.init_lr, "kernel": ml.kernel}


def check_memory_llama_shape(ml: MemoryLlamaConfig, hidden: int, model: str) -> None:
    """The memory's shape against the pretrained model's hidden size (RecipeError naming the key): the recipe
    check cannot, as only the model's config gives the width. ``heads`` must split the hidden size unless
    ``head_dim`` is set (more heads than channels gave zero-wide heads, and a non-divisor a memory narrower
    than the model without a word), and ``kernel: triton`` needs a memory the Triton kernels' tiles hold."""
    key = "memory.memory_llama."
    if ml.head_dim is None and (ml.heads > hidden or hidden % ml.heads):
        raise RecipeError(key + "heads", f"{ml.heads} heads do not split the hidden size {hidden} of {model}; use a "
                          f"divisor of {hidden} or set memory.memory_llama.head_dim")
    if ml.kernel == "triton":
        from memtrain.kernels.titans import kernel_unsupported, mlp_hidden

        head_dim = ml.head_dim or hidden // ml.heads
        why = kernel_unsupported(ml.depth, head_dim, mlp_hidden(head_dim, ml.expansion))
        if why is not None:
            raise RecipeError(key + "kernel", f"triton: {why} ({model}, {ml.heads} head(s)); use auto (the PyTorch "
                              "form where the kernels do not fit) or torch, or narrower heads (heads, head_dim)")


def lora_kwargs(ml: MemoryLlamaConfig) -> Optional[dict]:
    """``peft.LoraConfig`` arguments from ``memory.memory_llama.lora`` (None: no LoRA)."""
    lo = ml.lora
    if not lo.enabled:
        return None
    return {"r": lo.r, "lora_alpha": lo.alpha, "lora_dropout": lo.dropout, "target_modules": list(lo.target_modules)}


class MemoryLlamaLM(HFMemoryLM):
    """MemoryLlama (thesis Sections 4.1-4.2; :mod:`memtrain.model.titans.memory_llama`) behind memtrain's model
    interface: ``hf_model`` is the pretrained causal LM with every base weight frozen, LoRA adapters
    (``peft``; ``hf_model`` is then the ``PeftModel``) unless ``memory.memory_llama.lora.enabled`` is
    false, frozen with ``lora.freeze``, and gated Titans memory blocks injected into the decoder layers
    of ``memory.memory_llama.position`` / ``layers``.

    ``memory_parameters()``: the memory blocks and the LoRA adapters; ``anchor_parameters()``: the
    rest (the frozen base). There is no memory bank: ``forward`` takes ``memory=None`` only.

    Memory state: the blocks run in ``"auto"`` mode -- every forward of this wrapper (no KV cache)
    starts each sample of the batch from the initial memory ``M_0``, zero momentum and an empty
    convolution cache (per batch element; thesis Section 4.2.3's reset per sample). Switching between
    train and eval mode additionally drops any state a block kept (eval mode keeps the last state for
    KV-cached decoding), so evaluation never sees a state from before and none lingers in memory.
    """

    def __init__(self, hf_model: nn.Module, memory_cfg: MemoryConfig, model_cfg: Optional[ModelConfig] = None):
        from memtrain.model.titans.memory_llama import augment

        ml = memory_cfg.memory_llama or MemoryLlamaConfig()
        n_layers = text_config(hf_model.config).num_hidden_layers
        layers = decoder_layers(hf_model, n_layers)
        arch = type(hf_model).__name__
        inner = getattr(hf_model, "model", None)
        if layers is None or getattr(inner, "layers", None) is not layers:
            raise RecipeError(_KEY, f"{arch} is not supported by memory.type 'memory_llama': it needs a Llama-style "
                                    "causal LM with decoder layers at model.layers (LlamaForCausalLM)")
        for i, layer in enumerate(layers):
            missing = [a for a in ("input_layernorm", "self_attn")
                       if not isinstance(getattr(layer, a, None), nn.Module)]
            if missing:
                raise RecipeError(_KEY, f"{arch} is not supported by memory.type 'memory_llama': decoder layer {i} "
                                        f"({type(layer).__name__}) has no {', '.join(missing)}")
        if ml.layers is not None and any(i >= n_layers for i in ml.layers):
            raise RecipeError("memory.memory_llama.layers", f"{ml.layers} names blocks beyond the {n_layers} decoder "
                              f"layers of {model_cfg.pretrained if model_cfg else arch} (0-based: 0..{n_layers - 1})")
        check_memory_llama_shape(ml, text_config(hf_model.config).hidden_size,
                                 model_cfg.pretrained if model_cfg else arch)
        try:
            model = augment(hf_model, ml.position, ml.layers, memory_llama_kwargs(ml), lora_kwargs(ml),
                            ml.lora.freeze, every=ml.every, gate_bias_init=ml.gate_bias_init, residual=ml.residual)
        except ValueError as err:  # peft: LoRA target modules that are not in the model (as crossattn's adapters)
            if "target" not in str(err).lower():
                raise
            raise _lora_targets_error("memory.memory_llama.lora.target_modules", list(ml.lora.target_modules), arch,
                                      err) from None
        super().__init__(model, None, model_cfg=model_cfg)
        self.memory_llama = ml

    # -- parameters --------------------------------------------------------------------------------

    def blocks(self) -> list:
        from memtrain.model.titans.memory_llama import memory_blocks

        return memory_blocks(self.hf_model)

    def memory_block_parameters(self) -> list[nn.Parameter]:
        seen: set[int] = set()
        out = []
        for b in self.blocks():
            for p in b.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def lora_parameters(self) -> list[nn.Parameter]:
        return [p for n, p in self.hf_model.named_parameters() if "lora_" in n]

    def memory_parameters(self) -> list[nn.Parameter]:
        """The memory blocks and the LoRA adapters (trainable or frozen)."""
        return self.memory_block_parameters() + self.lora_parameters()

    def anchor_parameters(self) -> list[nn.Parameter]:
        """The pretrained base model's parameters (frozen)."""
        mem = {id(p) for p in self.memory_parameters()}
        return [p for p in self.hf_model.parameters() if id(p) not in mem]

    def param_groups(self, memory_lr: float, lora_lr: float, weight_decay: float) -> list[dict]:
        """AdamW groups (:func:`memtrain.model.titans.memory_llama.param_groups`) with the schedule's ``role``:
        ``memory`` (memory blocks) and ``lora`` (LoRA adapters, when they train)."""
        from memtrain.model.titans.memory_llama import param_groups

        groups = param_groups(self.hf_model, memory_lr, lora_lr, weight_decay)
        for g in groups:
            g["role"] = "lora" if g["name"].startswith("lora") else "memory"
        return groups

    def describe(self) -> list[str]:
        """Lines for `memtrain recipe show` and the training log: where the memories are and the sizes."""
        ml = self.memory_llama
        mem = sum(p.numel() for p in self.memory_block_parameters())
        lora = sum(p.numel() for p in self.lora_parameters())
        base = sum(p.numel() for p in self.anchor_parameters())
        layers = [b.layer_idx for b in self.blocks()]
        lines = [f"memory_llama: {ml.position} memory blocks in decoder layers {layers}: {mem:,} parameters "
                 f"(trainable, lr {ml.memory_lr:g})"]
        if ml.lora.enabled:
            state = "frozen" if ml.lora.freeze else f"trainable, lr {ml.lora_lr:g}"
            lines.append(f"memory_llama: LoRA r={ml.lora.r} alpha={ml.lora.alpha:g} on "
                         f"{', '.join(ml.lora.target_modules)}: {lora:,} parameters ({state})")
        else:
            lines.append("memory_llama: no LoRA")
        lines.append(f"memory_llama: frozen base model: {base:,} parameters")
        return lines

    # -- memory state and statistics ---------------------------------------------------------------

    def train(self, mode: bool = True) -> "MemoryLlamaLM":
        super().train(mode)
        from memtrain.model.titans.memory_llama import reset_memory

        reset_memory(self.hf_model)
        return self

    def gate_stats(self) -> dict[str, float]:
        """The ``memory_module/*`` scalars of the last forward
        (:func:`memtrain.model.titans.memory_llama.gate_stats`)."""
        from memtrain.model.titans.memory_llama import gate_stats

        return gate_stats(self.hf_model)

    def forward(self, input_ids: torch.Tensor, doc_ids: Optional[torch.Tensor] = None,
                memory: Optional[FetchedMemory] = None) -> ModelOutput:
        """``input_ids [B, T]``; every sample starts from a reset memory (see the class docstring)."""
        if memory is not None:
            raise ValueError("memory.type 'memory_llama' keeps its memories inside the model (no bank); "
                             "pass memory=None")
        return super().forward(input_ids, doc_ids)


# --------------------------------------------------------------------------------------------------
# Memory adapters: cross-attention memory layers in a frozen pretrained model (memory.type crossattn)


def _is_lora(name: str) -> bool:
    return "lora_" in name


class CrossAttnAdapterLM(HFMemoryLM):
    """Memory adapters (crossattn-memory-banks paper, Section 5.2) behind memtrain's model interface:
    ``hf_model`` is the pretrained causal LM (Llama, Qwen2, Gemma 3; a local folder or hub id) with every
    weight frozen, LoRA adapters on it when ``memory.crossattn.lora`` is set (``peft``; ``hf_model`` is
    then the ``PeftModel``), and ``crossattn`` the :class:`~memtrain.model.crossattn.CrossAttnMemory`
    whose memory layers are inserted into its decoder layers by hooks
    (:class:`~memtrain.model.crossattn.adapter.MemoryAdapterHooks`: variant A or B at Section 3.3's
    placement; shared or per-layer banks, chapter routing and the compressions of Section 5.3 as on
    ``model.type: decoder``). Zero effect at initialisation: ``W_O`` (and variant B's extra MLP output)
    start at zero, so the logits are the pretrained model's.

    Parameter groups (:func:`memtrain.parallel.engine.build_optimizer`): :meth:`memory_parameters` (``W_Q``,
    ``W_O``, routers, norms, variant B's MLP; role ``memory``, memory.optimizer.lr), :meth:`bank_parameters`
    (the banks and every layer's ``W_K``, ``W_V``; role ``bank``, memory.crossattn.bank_lr, frozen from
    memory.crossattn.freeze_bank_at on: Section 5.5's differential learning rates and staged freezing),
    :meth:`lora_parameters` (role ``lora``, memory.crossattn.lora_lr), :meth:`anchor_parameters` (the
    pretrained weights: frozen, or trained at train.optimizer.lr with ``memory.crossattn.train_base``).

    ``memory.crossattn.memory_layers: false`` inserts no memory layers (``crossattn`` is None): with LoRA,
    Section 5.4's LoRA-only baseline. ``forward`` takes no fetched memory (``memory=None``); ``doc_ids`` is
    ignored as in :class:`HFMemoryLM`; ``aux_loss`` is the chapter routers' load-balancing loss
    (memory.crossattn.balance_loss times its mean over the routed memory layers), as in
    :class:`~memtrain.model.anchor.DecoderLM`.
    """

    def __init__(self, hf_model: nn.Module, memory_cfg: MemoryConfig, model_cfg: Optional[ModelConfig] = None):
        from memtrain.model.crossattn.adapter import (MemoryAdapterHooks, attention_branch, check_placement,
                                                      layer_norm_factory)
        from memtrain.model.crossattn.layer import CrossAttnMemory, memory_layer_indices

        c = memory_cfg.crossattn or CrossAttnConfig()
        name = model_cfg.pretrained if model_cfg is not None and model_cfg.pretrained else type(hf_model).__name__
        tc = text_config(hf_model.config)
        n_layers = tc.num_hidden_layers
        layers = decoder_layers(hf_model, n_layers)
        if layers is None:
            raise RecipeError(_KEY, f"{type(hf_model).__name__}: cannot find its decoder layers; memory adapters "
                                    "attach to Llama, Qwen2 and Gemma 3 style models (model.layers[i])")
        try:
            dims = hf_anchor_dims(hf_model.config)
        except AttributeError as err:  # a config without hidden_size, intermediate_size, ...
            raise RecipeError(_KEY, f"{name} is not supported by memory adapters ({err}); they attach to Llama, "
                                    "Qwen2 and Gemma 3 style models") from err
        if c.memory_layers:
            check_placement(c, n_layers, c.dim or dims.q_width, c.heads or tc.num_attention_heads, name)
            if c.variant == "A":
                for i in memory_layer_indices(c, n_layers):
                    try:
                        attention_branch(layers[i])
                    except TypeError as err:
                        raise RecipeError(_KEY, f"{name} is not supported by memory adapters (variant A): {err}; "
                                                "memory.crossattn.variant B attaches to any decoder layer") from err
        hf_model.requires_grad_(c.train_base)
        lora = c.lora is not None and c.lora.enabled
        if lora:
            from peft import LoraConfig, get_peft_model

            try:
                hf_model = get_peft_model(hf_model, LoraConfig(
                    r=c.lora.r, lora_alpha=c.lora.alpha, lora_dropout=c.lora.dropout,
                    target_modules=list(c.lora.target_modules), task_type="CAUSAL_LM"))
            except ValueError as err:  # e.g. target modules that are not in the model
                raise _lora_targets_error("memory.crossattn.lora.target_modules", c.lora.target_modules, name,
                                          err) from err
            for n, p in hf_model.named_parameters():
                if _is_lora(n):
                    p.requires_grad_(not c.lora.freeze)
        super().__init__(hf_model, None, model_cfg=model_cfg)
        self.crossattn_cfg = c
        self.optimizer_lr = memory_cfg.optimizer.lr
        self.crossattn: Optional[CrossAttnMemory] = None
        self.adapter_hooks: Optional[MemoryAdapterHooks] = None
        if c.memory_layers:
            eps = getattr(tc, "rms_norm_eps", None) or 1e-6
            d = dims.d_model
            norm = layer_norm_factory(layers[0], d, eps) or (lambda: make_norm("rmsnorm", d, eps))
            self.crossattn = CrossAttnMemory(c, d, tc.num_attention_heads, dims.head_dim, n_layers, dims.ffn_dim, norm)
            self.adapter_hooks = MemoryAdapterHooks(self.crossattn, layers)

    # -- parameters --------------------------------------------------------------------------------

    def lora_parameters(self) -> list[nn.Parameter]:
        """The LoRA adapters (trainable or frozen); empty without LoRA."""
        return [p for n, p in self.hf_model.named_parameters() if _is_lora(n)]

    def anchor_parameters(self) -> list[nn.Parameter]:
        """The pretrained model's own weights (frozen unless memory.crossattn.train_base)."""
        lora = {id(p) for p in self.lora_parameters()}
        return [p for p in self.hf_model.parameters() if id(p) not in lora]

    def bank_parameters(self) -> list[nn.Parameter]:
        """The banks and every memory layer's W_K, W_V (Section 5.5: bank_lr, freeze_bank, freeze_bank_at)."""
        return self.crossattn.bank_parameters() if self.crossattn is not None else []

    def memory_parameters(self) -> list[nn.Parameter]:
        """The rest of the memory layers: W_Q, W_O, routers, norms, variant B's MLP (memory.optimizer)."""
        if self.crossattn is None:
            return []
        bank = {id(p) for p in self.bank_parameters()}
        return [p for p in self.crossattn.parameters() if id(p) not in bank]

    def describe(self) -> list[str]:
        """Lines for `memtrain recipe show` and the training log: the adapters, LoRA and the base model."""
        c = self.crossattn_cfg

        def count(params: list[nn.Parameter]) -> int:
            return sum(p.numel() for p in params)

        def state(params: list[nn.Parameter], lr: float) -> str:
            return f"trainable, lr {lr:g}" if any(p.requires_grad for p in params) else "frozen"

        lines = []
        if self.crossattn is not None:
            n = self.crossattn.parameter_counts()
            bank_lr = c.bank_lr if c.bank_lr is not None else self.optimizer_lr
            freeze = f", frozen after {c.freeze_bank_at}" if c.freeze_bank_at.value else ""
            lines.append(f"memory adapters: variant {c.variant} memory layers in decoder layers "
                         f"{self.crossattn.layer_indices}: {count(self.memory_parameters()):,} W_Q/W_O/router/norm"
                         + ("/MLP" if c.variant == "B" else "")
                         + f" parameters ({state(self.memory_parameters(), self.optimizer_lr)}), "
                         f"{count(self.bank_parameters()):,} bank + W_K/W_V parameters "
                         f"({state(self.bank_parameters(), bank_lr)}{freeze}); {n['banks']} bank(s) of {c.tokens} "
                         "tokens")
        else:
            lines.append("memory adapters: none (memory.crossattn.memory_layers false)")
        if c.lora is not None and c.lora.enabled:
            lines.append(f"memory adapters: LoRA r={c.lora.r} alpha={c.lora.alpha:g} on "
                         f"{', '.join(c.lora.target_modules)}: {count(self.lora_parameters()):,} parameters "
                         f"({state(self.lora_parameters(), c.lora_lr)})")
        else:
            lines.append("memory adapters: no LoRA")
        base = self.anchor_parameters()
        lines.append(f"memory adapters: base model {count(base):,} parameters ("
                     + ("trainable, train.optimizer.lr" if any(p.requires_grad for p in base) else "frozen") + ")")
        return lines

    # -- forward -----------------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, doc_ids: Optional[torch.Tensor] = None,
                memory: Optional[FetchedMemory] = None) -> ModelOutput:
        """``input_ids [B, T]``; ``doc_ids`` is ignored (attention crosses documents, as in :class:`HFMemoryLM`)."""
        if memory is not None:
            raise ValueError("memory.type 'crossattn' keeps its memory inside the model (no fetched memory); "
                             "pass memory=None")
        if self.adapter_hooks is None:
            return super().forward(input_ids, doc_ids)
        with self.adapter_hooks.collecting() as losses:
            logits = super().forward(input_ids, doc_ids).logits
        aux = None
        if losses and self.crossattn_cfg.balance_loss:
            # Load balancing (Switch-style), averaged over the routed memory layers; the trainer adds it to the loss.
            aux = self.crossattn_cfg.balance_loss * torch.stack(losses).mean()
        return ModelOutput(logits=logits, aux_loss=aux)


__all__ = ["CrossAttnAdapterLM", "HFMemoryLM", "MemoryLlamaLM", "check_gated_mlps", "check_memory_llama_shape",
           "decoder_layers", "hf_anchor_dims", "load_causal_lm", "lora_kwargs", "memory_llama_kwargs", "text_config"]
