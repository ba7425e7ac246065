"""Titans neural long-term memory (Behrouz, Zhong, Mirrokni 2025).

- :class:`NeuralMemory` (:mod:`.memory`): the LMM layer -- projections, convolutions, gates, inner
  loop, output norm/gate/projection; ``forward`` writes and reads, ``retrieve`` only reads.
- :class:`MemoryState` (:mod:`.state`): the state carried between calls.
- :func:`memory_scan` (:mod:`.inner_loop`): the inner loop itself, ``algorithm="chunked"``
  (Section 3.2) or ``"sequential"`` (per-token reference).
- :mod:`.arch`: the LMM / MAC / MAG / MAL language models (``model.type: titans``);
  :mod:`.attention`: their sliding-window and segment attention.
- :mod:`.memory_llama`: the memory injected into a pretrained Llama as gated blocks (MemoryLlama:
  ELMA, ALMA, GeMA), wrapped by :class:`memtrain.model.hf.MemoryLlamaLM`.

Imports torch only.
"""

from memtrain.model.titans.inner_loop import ALGORITHMS, memory_scan, mlp_forward, mlp_grads
from memtrain.model.titans.memory import GATE_MODES, NeuralMemory
from memtrain.model.titans.state import MemoryState

__all__ = ["ALGORITHMS", "GATE_MODES", "MemoryState", "NeuralMemory", "memory_scan", "mlp_forward", "mlp_grads"]
