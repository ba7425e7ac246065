"""Models: the anchor decoder (:mod:`.anchor`), its attention paths (:mod:`.attention`), FLOP
accounting (:mod:`.flops`), pretrained Hugging Face models (:mod:`.hf`), and one folder per memory
family: :mod:`.hierarchical` (hierarchical parametric memories: block layout, generic memory, memory
ops) and :mod:`.titans` (neural long-term memory, LMM/MAC/MAG/MAL as ``model.type: titans``, and
MemoryLlama's gated memory blocks).

Models consume tensors: token ids, document ids (computed by the data loader) and fetched memory;
they never import data, parallel, eval or the launcher, nor DeepSpeed or torch.distributed.

Imports torch only (never DeepSpeed, streaming or transformers), so models can be built and
benchmarked alone. :func:`build` works under ``with torch.device("meta"):`` for parameter counts.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

from memtrain.config import MemoryConfig, ModelConfig
from memtrain.errors import SettingError
from memtrain.model.anchor import DecoderLM, ModelOutput, position_ids_from_doc_ids
from memtrain.model.flops import count_parameters, flops_per_token, peak_flops
from memtrain.model.switches import check_flags
from memtrain.model.titans.arch import TitansLM, TitansOutput


def build(model_cfg: ModelConfig, memory_cfg: Optional[MemoryConfig] = None, branching: int = 16) -> nn.Module:
    """The model a recipe describes: the anchor decoder (``model.type: decoder``), a Titans model
    (``model.type: titans``) or a pretrained Hugging Face model (``model.type: hf``), with the
    hierarchical memories of ``memory_cfg`` (``branching`` = data.clustering.branching). SettingError (one line)
    where an on/off switch of :mod:`memtrain.model.switches` holds a value other than 0 or 1."""
    try:
        check_flags()
    except ValueError as e:
        raise SettingError(str(e)) from None
    if model_cfg.type not in ("decoder", "titans", "hf"):
        raise ValueError(f"unknown model.type {model_cfg.type!r}; expected 'decoder', 'titans' or 'hf'")
    if model_cfg.type == "hf":
        from memtrain.model.hf import HFMemoryLM

        return HFMemoryLM.from_config(model_cfg, memory_cfg, branching)
    if model_cfg.type == "titans":
        if memory_cfg is not None and memory_cfg.enabled:
            raise ValueError("hierarchical memories attach to model.type 'decoder' or 'hf', not 'titans'")
        return TitansLM(model_cfg)
    return DecoderLM(model_cfg, memory_cfg, branching)


__all__ = [
    "DecoderLM", "ModelOutput", "TitansLM", "TitansOutput", "build", "count_parameters",
    "flops_per_token", "peak_flops", "position_ids_from_doc_ids",
]
