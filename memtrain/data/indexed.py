"""A ``StreamingDataset`` whose samples carry their global sample index.

Streaming fixes one global order of sample indices (the same on any number of ranks, see
:mod:`memtrain.data.loader`); a sample's index therefore names it independently of which rank and
micro-batch it lands in. The trainer keys per-sample randomness on it (the generic-memory draw), so
that a step draws the same way on 1, 2 or 3 ranks. Kept apart from the loader because it imports
Streaming at module level (a subclass needs its base), and the loader does so only when building.
"""

from __future__ import annotations

from typing import Any

from streaming import StreamingDataset



class IndexedStreamingDataset(StreamingDataset):
    """``StreamingDataset`` adding ``sample["sample_index"]`` (the global index) to every sample it reads;
    :class:`memtrain.data.loader.Collate` turns them into the batch's ``sample_index`` tensor."""

    def get_item(self, sample_id: int, retry: int = 7) -> Any:
        sample = super().get_item(sample_id, retry)
        return {**sample, "sample_index": int(sample_id)}


__all__ = ["IndexedStreamingDataset"]
