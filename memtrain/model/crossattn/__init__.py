"""Learnable cross-attention memory banks (crossattn-memory-banks paper): latent-token banks
(:mod:`.bank`), chapter routing and routed attention (:mod:`.routing`), memory cross-attention layers and
the set of them a model carries (:mod:`.layer`)."""

from memtrain.model.crossattn.bank import LatentBank
from memtrain.model.crossattn.layer import (CrossAttnMemory, MemoryBlockPart, MemoryCrossAttention, RoutingStats,
                                            memory_layer_indices)
from memtrain.model.crossattn.routing import (ChapterRouter, DocumentSegments, Routing, dense_routed_attention,
                                              full_bank_attention, routed_attention, sequence_routed_attention)

__all__ = ["ChapterRouter", "CrossAttnMemory", "DocumentSegments", "LatentBank", "MemoryBlockPart",
           "MemoryCrossAttention", "Routing", "RoutingStats", "dense_routed_attention", "full_bank_attention",
           "memory_layer_indices", "routed_attention", "sequence_routed_attention"]
