"""Memory adapters: the memory layers of a :class:`~memtrain.model.crossattn.layer.CrossAttnMemory` inserted
into the decoder layers of a pretrained Hugging Face causal LM (crossattn-memory-banks paper, Section 5.2:
"we insert memory cross-attention layers at selected positions while keeping the original weights frozen").

No Hugging Face code is copied and no module of the pretrained model is replaced: its state-dict keys stay
as they are, and the memory layers are attached by hooks at the placement of Section 3.3
(``memory.crossattn.placement`` / ``placement_k`` / ``layers``):

- **Variant A** (Section 3.2: self-attention -> memory cross-attention -> MLP). A forward pre-hook on the
  decoder layer keeps its input ``x``. A forward hook on the *attention branch* -- the module whose output
  ``o`` the layer adds to its residual stream -- returns ``o + MemAttn(norm(x + o))`` (eq. 1-4 / 21), so
  the layer's own residual add gives ``h = x + o + MemAttn(norm(x + o))``, and the layer's MLP branch
  (its norm, MLP and residual add) then runs on ``h``: exactly variant A. The attention branch is
  ``self_attn`` in Llama and Qwen2 (``h = x + self_attn(input_layernorm(x))``). Gemma 2/3 normalise the
  attention output before the residual add (``h = x + post_attention_layernorm(self_attn(...))``; their
  MLP input norm is ``pre_feedforward_layernorm``): hooking ``self_attn`` there would put the memory read
  *inside* ``post_attention_layernorm``, so the hook goes on ``post_attention_layernorm`` instead.
  :func:`attention_branch` picks it: layers with a ``post_feedforward_layernorm`` (Gemma 2/3, OLMo 2:
  both branches normalised before their residual add) are hooked at ``post_attention_layernorm``.
- **Variant B** (self-attention -> MLP -> memory cross-attention -> another MLP). A forward hook on the
  decoder layer's output ``y`` returns ``MemoryBlockPart(y)``: ``y + MemAttn(norm(y))``, then plus the
  extra SwiGLU MLP of its norm.

No effect at initialisation (Section 5: an adapter starts as the identity): every memory layer's ``W_O``
and variant B's extra MLP output are zero-initialised (:mod:`.layer`), so both hooks add exact zeros and
the logits are the pretrained model's, bit for bit. The router (Section 4.3) gets gradients only once
``W_O`` has left zero (after the first step).

The memory layers' norms are the pretrained model's own RMSNorm class with its epsilon
(:func:`layer_norm_factory`; Gemma's ``(1 + w)`` gain included), so a memory read sees the same kind of
normalised input as the layer's own sublayers.

Routing losses (Section 4.3's load balancing) and routing statistics of one forward are collected by
:meth:`MemoryAdapterHooks.collecting`; a hook running outside it (``generate``, a recomputation under activation
checkpointing during backward) reads memory normally and records neither. Sequence routing pools the whole
row, as the pretrained model's attention crosses the documents of a packed row (:mod:`memtrain.model.hf`).
Generation with ``sequence`` routing routes each decoding step on the tokens of that step only (mean pooling
over the new tokens); ``token`` routing and the unrouted bank do not have this caveat.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from memtrain.config import CrossAttnConfig, RecipeError
from memtrain.model.crossattn.layer import CrossAttnMemory, memory_layer_indices

_KEY = "memory.crossattn."


def attention_branch(layer: nn.Module) -> nn.Module:
    """The module whose output a decoder layer adds to its residual stream after self-attention (module
    docstring): ``post_attention_layernorm`` for layers that normalise both branches before their
    residual adds (those with a ``post_feedforward_layernorm``: Gemma 2/3, OLMo 2), else ``self_attn``
    (Llama, Qwen2, Mistral). TypeError for a layer with neither."""
    if isinstance(getattr(layer, "post_feedforward_layernorm", None), nn.Module):
        branch = getattr(layer, "post_attention_layernorm", None)
    else:
        branch = getattr(layer, "self_attn", None)
    if not isinstance(branch, nn.Module):
        raise TypeError(f"{type(layer).__name__} has no self_attn (or post-attention norm) to attach a memory "
                        "read to; memory adapters support Llama, Qwen2 and Gemma 3 style decoder layers")
    return branch


def layer_norm_factory(layer: nn.Module, d_model: int, eps: Optional[float] = None
                       ) -> Optional[Callable[[], nn.Module]]:
    """A factory of the layer's own RMSNorm class (``input_layernorm``'s, else ``post_attention_layernorm``'s)
    at width ``d_model`` with that norm's epsilon (or ``eps``); None when the layer has no such norm or its
    class does not construct as ``cls(d_model, eps=...)``."""
    for name in ("input_layernorm", "post_attention_layernorm"):
        norm = getattr(layer, name, None)
        if isinstance(norm, nn.Module):
            break
    else:
        return None
    norm_eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", None) or eps or 1e-6
    cls = type(norm)
    try:
        cls(d_model, eps=norm_eps)
    except TypeError:
        return None
    return lambda: cls(d_model, eps=norm_eps)


def check_placement(c: CrossAttnConfig, n_layers: int, width: int, heads: int, model: str) -> None:
    """The checks of the recipe's placement and widths against the pretrained model's shape (RecipeError
    naming the key): on ``model.type: hf`` the recipe's ``model.*`` shape keys do not describe the model."""
    if c.layers is not None and any(not 0 <= i < n_layers for i in c.layers):
        raise RecipeError(_KEY + "layers", f"{c.layers} names decoder layers beyond the {n_layers} layers of {model} "
                          f"(0-based: 0..{n_layers - 1})")
    if c.layers is None and c.placement in ("first", "last") and c.placement_k > n_layers:
        raise RecipeError(_KEY + "placement_k", f"{c.placement_k} is more than the {n_layers} decoder layers of "
                          f"{model}")
    if heads < 1 or width % heads:
        raise RecipeError(_KEY + "heads", f"the memory attention width {width} (memory.crossattn.dim, default the "
                          f"attention width of {model}) does not split into {heads} heads")
    if not memory_layer_indices(c, n_layers):
        raise RecipeError(_KEY + "placement", f"places no memory layer in the {n_layers} layers of {model}")


class MemoryAdapterHooks:
    """The hooks that insert ``memory``'s layers into the decoder ``layers`` (variant A or B, module
    docstring), and the routing losses of the current forward."""

    def __init__(self, memory: CrossAttnMemory, layers: nn.ModuleList):
        self.memory = memory
        self.variant = memory.cfg.variant
        self._inputs: dict[int, torch.Tensor] = {}
        self._losses: Optional[list[torch.Tensor]] = None
        self.handles: list = []
        for i in memory.layer_indices:
            layer = layers[i]
            if self.variant == "A":
                branch = attention_branch(layer)
                self.handles.append(layer.register_forward_pre_hook(partial(self._keep_input, i), with_kwargs=True))
                self.handles.append(branch.register_forward_hook(partial(self._read_after_attention, i)))
            else:
                self.handles.append(layer.register_forward_hook(partial(self._read_after_layer, i)))

    @contextlib.contextmanager
    def collecting(self) -> Iterator[list[torch.Tensor]]:
        """The routing losses of the memory reads inside this block (one per routed memory layer)."""
        previous, self._losses = self._losses, []
        try:
            yield self._losses
        finally:
            self._losses = previous
            self._inputs.clear()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []

    # -- the hooks -----------------------------------------------------------------------------------

    def _keep_input(self, i: int, layer: nn.Module, args: tuple, kwargs: dict) -> None:
        self._inputs[i] = args[0] if args else kwargs["hidden_states"]

    def _read_after_attention(self, i: int, branch: nn.Module, args: tuple, output: Any) -> Any:
        """Variant A: ``o -> o + MemAttn(norm(x + o))``."""
        x = self._inputs.pop(i, None)
        if x is None:
            raise RuntimeError(f"memory adapter of decoder layer {i}: its attention ran outside the layer's forward")
        o = output[0] if isinstance(output, tuple) else output
        part = self.memory.parts[str(i)]
        dtype = part.norm.weight.dtype if hasattr(part.norm, "weight") else o.dtype
        read, loss = part.attn(part.norm((x + o).to(dtype)), self.memory.bank_for(i), self._recorder(i))
        self._collect(loss)
        o = o + read.to(o.dtype)
        return (o, *output[1:]) if isinstance(output, tuple) else o

    def _read_after_layer(self, i: int, layer: nn.Module, args: tuple, output: Any) -> Any:
        """Variant B: ``y -> y + MemAttn(norm(y))``, then plus the extra MLP."""
        y = output[0] if isinstance(output, tuple) else output
        part = self.memory.parts[str(i)]
        dtype = part.norm.weight.dtype if hasattr(part.norm, "weight") else y.dtype
        h, loss = part(y.to(dtype), self.memory.bank_for(i), self._recorder(i))
        self._collect(loss)
        h = h.to(y.dtype)
        return (h, *output[1:]) if isinstance(output, tuple) else h

    def _recorder(self, i: int) -> Optional[Callable]:
        """Routing statistics count the reads of a collected forward only (not a recomputation in backward)."""
        return self.memory.recorder(i) if self._losses is not None else None

    def _collect(self, loss: Optional[torch.Tensor]) -> None:
        if loss is not None and self._losses is not None:
            self._losses.append(loss)


__all__ = ["MemoryAdapterHooks", "attention_branch", "check_placement", "layer_norm_factory"]
