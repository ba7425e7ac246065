"""memtrain: distributed pretraining of language models with memory, built on DeepSpeed.

Layers, each importing only those below it (enforced by import-linter, ``.importlinter``):
``launcher`` (command line, training loop, Slurm) > ``eval`` (every evaluation) > ``data`` (corpora,
tokenizers, clustering, MDS shards, loaders) > ``parallel`` (process groups, DeepSpeed engine, memory
banks, collectives, checkpoints) > ``model`` (anchors and one folder per memory family) > ``kernels``
(Triton kernels beside their PyTorch references) > ``config`` (the recipe schema) > ``errors``.
See ARCHITECTURE.md. Importing this package imports nothing heavy.
"""

__version__ = "0.1.0"
