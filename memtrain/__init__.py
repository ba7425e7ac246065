"""memtrain: distributed pretraining of language models with memory, built on DeepSpeed.

Subpackages: ``launcher`` (command line, process groups, training loop, Slurm), ``model`` (anchor
decoder and memory modules), ``parallel`` (DeepSpeed engine, checkpoints), ``kernels`` (Triton
kernels beside their PyTorch references), ``data`` (corpora, tokenizers, MDS shards, loaders).
Importing this package imports nothing heavy.
"""

__version__ = "0.1.0"
