"""Hierarchical parametric memories (Pouransari et al.): one folder for the family's model side.

- :mod:`.layout`: how a cluster's block is laid out over the anchor's layers (FFN, LoRA, KV memories),
  its sizes and its initialisation (:class:`MemoryLayout`);
- :mod:`.memory`: what the model receives (:class:`FetchedMemory`), the generic memory and the memory
  ops batched over sequences.

The bank that stores and fetches the rows is :mod:`memtrain.parallel.bank` (and
:mod:`memtrain.parallel.sharded_bank`); the evaluation is :mod:`memtrain.eval.hierarchical`.
Imports torch only.
"""

from memtrain.model.hierarchical.layout import AnchorDims, MemoryLayout, Part, placement_layers, spread, unit_parts
from memtrain.model.hierarchical.memory import (
    FetchedMemory, GenericMemory, ffn_memory, generic_mask, kv_memory, lora_delta,
)

__all__ = [
    "AnchorDims", "FetchedMemory", "GenericMemory", "MemoryLayout", "Part", "ffn_memory", "generic_mask", "kv_memory",
    "lora_delta", "placement_layers", "spread", "unit_parts",
]
