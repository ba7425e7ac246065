"""Every evaluation of a trained checkpoint, called by `memtrain eval` (:mod:`memtrain.launcher.cli`).

- :mod:`.evaluate`: the command: load the recipe's model and the checkpoint, run what applies, write
  the JSON report and the table;
- :mod:`.hierarchical`: hierarchical memories: val perplexity and long-tail fact probes per memory mode
  (fetched, generic, blocked, corrupted retrieval);
- :mod:`.longctx`: long-context tasks answered by greedy generation (window or streamed memory);
- :mod:`.tasks`: the S-NIAH and BABILong-style task generators and scoring (offline, no model);
- :mod:`.common`: what they share: the memory argument of a batch, prompt encoding, padding, result
  cells, the report file.

A new family's evaluation (cross-attention memory banks) goes here as one more module beside these.
Importing this package imports nothing; the modules import torch and numpy, and load Streaming,
sentence-transformers and the model code in the functions that use them.
"""
