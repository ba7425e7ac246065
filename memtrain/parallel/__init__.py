"""Process groups (:mod:`.dist`), the DeepSpeed engine (:mod:`.engine`), counted collectives
(:mod:`.comm`), the replicated and row-sharded memory banks (:mod:`.bank`, :mod:`.sharded_bank`),
checkpoints (:mod:`.checkpoint`, :mod:`.checkpoint_folder`, :mod:`.bank_checkpoint`) and the run
directory's lock (:mod:`.run_lock`)."""
