"""Command line, process-group discovery, the training loop and Slurm submission."""
