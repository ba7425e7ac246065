"""The memory bank of latent tokens (crossattn-memory-banks paper, Sections 3.1 and 5.3).

``M`` (``N_m x width``) is a plain learned matrix, the low-rank product ``A B^T`` (eq. 13: ``A`` is
``N_m x r``, ``B`` is ``width x r``), or int8 storage with one scale per token (quantised storage, a
frozen bank: no gradient reaches int8 values; an fp32 bank of a checkpoint is quantised on load). Every
kind answers :meth:`rows` (the tokens of given indices, in the compute dtype) and :meth:`chapters`
(whole chapters), so a layer never needs the whole bank when it reads a few chapters of a factorised
or quantised one.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn


class LatentBank(nn.Module):
    """``N_m`` latent tokens of width ``width`` in ``n_chapters`` equal chapters (eq. 7)."""

    def __init__(self, tokens: int, width: int, chapters: int = 1, rank: Optional[int] = None,
                 dtype: str = "fp32", init_std: float = 1.0):
        super().__init__()
        if tokens % chapters:
            raise ValueError(f"{tokens} tokens do not split into {chapters} equal chapters")
        self.tokens, self.width, self.n_chapters, self.rank = tokens, width, chapters, rank
        self.chapter_tokens = tokens // chapters
        self.kind = "lowrank" if rank else ("int8" if dtype == "int8" else "dense")
        self.init_std = init_std
        store = torch.bfloat16 if dtype == "bf16" else torch.float32
        if self.kind == "lowrank":
            self.a = nn.Parameter(torch.empty(tokens, rank, dtype=store))
            self.b = nn.Parameter(torch.empty(width, rank, dtype=store))
        elif self.kind == "int8":
            self.register_buffer("q", torch.zeros(tokens, width, dtype=torch.int8))
            self.register_buffer("scale", torch.ones(tokens, 1, dtype=torch.float32))
        else:
            self.weight = nn.Parameter(torch.empty(tokens, width, dtype=store))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.kind == "lowrank":
            if self.a.is_meta:
                return
            # A B^T keeps the dense bank's per-entry variance: var(sum_r a b) = r * sa^2 * sb^2 = std^2.
            nn.init.normal_(self.a, std=math.sqrt(self.init_std) / self.rank ** 0.25)
            nn.init.normal_(self.b, std=math.sqrt(self.init_std) / self.rank ** 0.25)
        elif self.kind == "dense":
            if not self.weight.is_meta:
                nn.init.normal_(self.weight, std=self.init_std)
        elif not self.q.is_meta:  # int8: the dense bank's draw, quantised (a frozen random bank until loaded)
            q, scale = self.quantize(torch.randn(self.tokens, self.width, device=self.q.device) * self.init_std)
            self.q.copy_(q)
            self.scale.copy_(scale)

    # -- reading ------------------------------------------------------------------------------------

    def rows(self, index: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The tokens ``index`` (any shape) as ``[*index.shape, width]`` in ``dtype`` (default: the
        storage dtype; int8 banks default to float32)."""
        if self.kind == "lowrank":
            out = self.a[index] @ self.b.t()
        elif self.kind == "int8":
            out = self.q[index].float() * self.scale[index]
        else:
            out = self.weight[index]
        return out if dtype is None else out.to(dtype)

    def chapters(self, ids: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Whole chapters ``ids`` (any shape) as ``[*ids.shape, chapter_tokens, width]``."""
        offsets = torch.arange(self.chapter_tokens, device=ids.device)
        return self.rows(ids[..., None] * self.chapter_tokens + offsets, dtype)

    def all(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The whole bank ``[N_m, width]``."""
        return self.rows(torch.arange(self.tokens, device=self._device()), dtype)

    def _device(self) -> torch.device:
        return (self.q if self.kind == "int8" else next(self.parameters())).device

    @property
    def parameter_count(self) -> int:
        """Stored numbers: N_m x width, (N_m + width) x r (eq. 13), or N_m x width int8 values + N_m scales."""
        if self.kind == "lowrank":
            return (self.tokens + self.width) * self.rank
        if self.kind == "int8":
            return self.tokens * self.width + self.tokens
        return self.tokens * self.width

    # -- int8 -----------------------------------------------------------------------------------------

    @staticmethod
    def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Symmetric per-token int8: ``q = round(w / s)``, ``s = max|w_row| / 127``."""
        w = weight.float()
        scale = w.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 127.0
        return torch.round(w / scale).clamp(-127, 127).to(torch.int8), scale

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # An int8 bank accepts the fp32/bf16 weight of a checkpoint trained with a dense bank: quantised here.
        if self.kind == "int8" and prefix + "weight" in state_dict and prefix + "q" not in state_dict:
            q, scale = self.quantize(state_dict.pop(prefix + "weight"))
            state_dict[prefix + "q"], state_dict[prefix + "scale"] = q, scale
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def extra_repr(self) -> str:
        return (f"tokens={self.tokens}, width={self.width}, chapters={self.n_chapters}, kind={self.kind}"
                + (f", rank={self.rank}" if self.rank else ""))


__all__ = ["LatentBank"]
