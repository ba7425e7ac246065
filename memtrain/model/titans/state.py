"""The carried state of a Titans neural long-term memory (:class:`MemoryState`).

One state holds everything needed to continue a sequence exactly where the previous call stopped,
at any position (not only at chunk boundaries):

- ``weights``: the memory MLP's weights M_t after the last processed token, one tensor per layer,
  ``[B, H, d_out, d_in]`` (per batch element, per head);
- ``momentum``: the surprise S_t (same shapes);
- ``chunk_weights``: M_{t'}, the weights at the start of the current chunk, at which the gradients of
  the rest of that chunk are taken (mini-batch gradient descent, Titans Section 3.2). When ``pos`` is
  a multiple of the chunk size these are the same tensors as ``weights``;
- ``pos``: the absolute number of tokens processed (chunks are aligned to absolute positions, so
  ``pos % chunk_size`` is the offset inside the current chunk);
- ``chunk_gates``: ``gate_mode="chunk"`` only, the gate pre-activations ``[B, H, 3]`` of the current
  (partial) chunk, taken from its first token; ``None`` otherwise or at a chunk boundary;
- ``conv_cache``: the last ``kernel - 1`` rows fed to the causal depthwise q/k/v convolutions,
  ``[B, kernel - 1, 3 * heads * head_dim]`` (``None`` for the bare inner loop).

The state is part of the autograd graph (the inner loop is differentiable); call :meth:`detach` to
truncate back-propagation between calls.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch


@dataclass
class MemoryState:
    weights: tuple[torch.Tensor, ...]
    momentum: tuple[torch.Tensor, ...]
    chunk_weights: tuple[torch.Tensor, ...]
    pos: int = 0
    chunk_gates: Optional[torch.Tensor] = None
    conv_cache: Optional[torch.Tensor] = None

    @property
    def batch_size(self) -> int:
        return self.weights[0].shape[0]

    def detach(self) -> "MemoryState":
        """The same state cut from the autograd graph (truncated back-propagation through time)."""

        def d(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if t is None else t.detach()

        weights = tuple(w.detach() for w in self.weights)
        same = all(c is w for c, w in zip(self.chunk_weights, self.weights))
        return replace(
            self, weights=weights, momentum=tuple(s.detach() for s in self.momentum),
            chunk_weights=weights if same else tuple(w.detach() for w in self.chunk_weights),
            chunk_gates=d(self.chunk_gates), conv_cache=d(self.conv_cache),
        )


__all__ = ["MemoryState"]
