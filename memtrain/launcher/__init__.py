"""The top layer: the `memtrain` command line (:mod:`.cli`), the training loop (:mod:`.train`), Slurm
submission (:mod:`.submit`) and the metrics log (:mod:`.metrics`). Verbs call the layers below."""
