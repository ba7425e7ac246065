"""The training loop: `memtrain train RECIPE [key=value ...]`.

One optimizer step = ``grad_accum`` micro-batches on every rank, together ``train.global_batch_tokens``
tokens. DeepSpeed owns the forward/backward/step mechanics (ZeRO, precision, clipping, gradient
averaging); this loop owns data, evaluation, logging, checkpoints and resume.

Resume is automatic: running the same command again continues from the newest complete checkpoint in
``run.dir`` and reproduces the uninterrupted loss trajectory (model, optimizer, scheduler, data-loader
position and every rank's RNG state are restored). SIGTERM or SIGUSR1 (Slurm preemption) make the
loop finish the current step, write a checkpoint and exit cleanly.

``memory.type: memory_llama`` (Titans memories inside a frozen Hugging Face Llama) has no memory bank:
the memory blocks and LoRA adapters are ordinary parameter groups of DeepSpeed's optimizer, each on its
own learning rate (``optim/memory_lr``, ``optim/lora_lr``); logged steps add the blocks' gate,
contribution and weight-norm statistics (``memory_module/*``). Every forward starts each sample from a
reset memory (the blocks' ``auto`` mode), validation included.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from typing import Optional

import torch
import torch.nn.functional as F

from memtrain.config import Recipe, RecipeError
from memtrain.errors import CheckpointError, LaunchError
from memtrain.parallel import dist
from memtrain.launcher.metrics import MetricsWriter, format_line


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


class _StopFlag:
    """Set by SIGTERM/SIGUSR1; checked (and agreed on by all ranks) once per step."""

    def __init__(self) -> None:
        self.raised = False
        self._previous = {}

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. called from a test harness thread)
                pass

    def _handle(self, signum, frame) -> None:
        self.raised = True

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _all_mean(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(t)
        t /= torch.distributed.get_world_size()
    return t.tolist()


def _any(flag: bool, device: torch.device) -> bool:
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item())


def _to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _next_batch(batches) -> dict:
    """The next training micro-batch, without touching the global CPU RNG: creating a DataLoader
    iterator draws its base seed from it, and a resumed run creates its iterator at another point of
    the stream than the uninterrupted run did, which would shift every later random draw of the model
    (e.g. LoRA dropout on CPU) and break the exact resume."""
    with torch.random.fork_rng(devices=[]):
        return next(batches)


def eval_memory(bank, batch: dict, mode: str):
    """The memory a validation batch uses: ``fetched`` (its cluster ids), ``generic`` (the generic
    block for every sequence) or ``none`` (the anchor alone). Evaluation fetches are not counted."""
    if bank is None or mode == "none":
        return None
    from memtrain.model.hierarchical import FetchedMemory

    if mode == "generic":
        return FetchedMemory.all_generic(batch["input_ids"].shape[0], bank.layout.depth, batch["input_ids"].device)
    return bank.fetch(batch["cluster_ids"], count=False)


@torch.no_grad()
def evaluate(engine, loader_factory, batches: int, device: torch.device, bank=None,
             memory: str = "fetched") -> Optional[float]:
    """Mean validation loss over the first ``batches`` micro-batches of every rank's val split, with
    ``memory`` as in :func:`eval_memory` when the model has memories."""
    if loader_factory is None:
        return None
    engine.eval()
    total, count = 0.0, 0
    for i, batch in enumerate(loader_factory()):
        if i >= batches:
            break
        batch = _to_device(batch, device)
        out = engine(batch["input_ids"], doc_ids=batch["doc_ids"], memory=eval_memory(bank, batch, memory))
        total += float(lm_loss(out.logits, batch["labels"]))
        count += 1
    engine.train()
    total, count = _all_mean([total, float(count)], device)
    return total / count if count else None


def clip_memory(engine, bank, recipe: Recipe, joint: bool, joint_norm=None) -> dict[str, float]:
    """Clip at the accumulation boundary, before the anchor's and the bank's optimizer steps.

    ``joint``: one global norm over the anchor's gradients and the bank's, both scaled by
    ``min(1, clip / (norm + 1e-6))``. Under ZeRO 0 (fp32) the anchor's gradients are plain ``.grad``
    (already averaged over ranks by DeepSpeed's backward) and this scales both; DeepSpeed's own clipping
    is off. Under ZeRO 1-3 (``joint_norm``, a :class:`memtrain.parallel.engine.JointNorm`) DeepSpeed
    computes the anchor's norm inside ``engine.step()`` and clips by the joint one: this only hands it
    the bank's norm, and :func:`clip_memory_after_step` scales the bank afterwards. ``separate``:
    DeepSpeed clips the anchor, the bank is clipped by its own norm. Returns the pre-clip norms (total
    NaN until the step when DeepSpeed computes it)."""
    clip = recipe.train.grad_clip
    bank_norm = bank.grad_norm()
    if joint and joint_norm is not None:
        joint_norm.bank_norm = bank_norm
        return {"total": float("nan"), "bank": bank_norm}
    if joint:
        grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
        anchor = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        total = math.sqrt(anchor**2 + bank_norm**2)
        if clip > 0:
            coef = min(1.0, clip / (total + 1e-6))
            if coef < 1.0:
                for g in grads:
                    g.mul_(coef)
                bank.scale_gradients(coef)
        return {"total": total, "bank": bank_norm}
    anchor = float("nan")
    if recipe.parallel.zero_stage == 0:  # DeepSpeed reports no norm here; the anchor's own, for the logs
        grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
        anchor = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
    if clip > 0:
        bank.scale_gradients(min(1.0, clip / (bank_norm + 1e-6)))
    return {"total": anchor, "bank": bank_norm}


def clip_memory_after_step(bank, joint_norm, norms: dict[str, float]) -> dict[str, float]:
    """ZeRO 1-3 joint clipping, after ``engine.step()``: scale the bank by the factor DeepSpeed applied
    to the anchor (the joint norm's) and report the joint pre-clip norm."""
    coef = joint_norm.coefficient()
    if coef < 1.0:
        bank.scale_gradients(coef)
    return {**norms, "total": joint_norm.total}


def _log(msg: str, rank: int) -> None:
    if rank == 0:
        print(f"memtrain: {msg}", flush=True)


def train(recipe: Recipe) -> dict:
    """Run (or resume) training to ``train.max_steps``; returns a summary of the last step."""
    from memtrain.data.loader import LoaderIterator, build_loader, recipe_meta
    from memtrain.model import build, flops_per_token, peak_flops, count_parameters
    from memtrain.parallel import checkpoint as ckpt
    from memtrain.parallel.engine import global_grad_norm, initialize, joint_clipping, lr_at, precision

    dist_env = dist.discover()
    device = dist.resolve_device(recipe.run.device, dist_env)
    prec = precision(recipe, device)
    accum = recipe.grad_accum_steps(dist_env.world_size)  # RecipeError before anything is written
    meta = recipe_meta(recipe)  # DataError when `memtrain prepare` has not run
    if recipe.model.type != "hf" and meta["vocab_size"] > recipe.model.vocab_size:
        raise RecipeError("model.vocab_size", f"{recipe.model.vocab_size} is smaller than the tokenizer's "
                          f"{meta['vocab_size']} tokens in {recipe.data_dir}")
    run_dir = recipe.run_dir
    latest = ckpt.latest_checkpoint(run_dir)
    if latest is not None and not recipe.checkpoint.resume:
        raise CheckpointError(f"{run_dir} already holds checkpoints (newest {latest.tag}) and checkpoint.resume "
                              "is false; resume it, or choose a new run.dir")

    dist.init(dist_env, device, recipe.parallel.backend)
    rank, world = dist_env.rank, dist_env.world_size
    import deepspeed

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    deepspeed.utils.logger.setLevel(logging.WARNING)

    torch.manual_seed(recipe.run.seed)  # identical initial weights on every rank
    model = build(recipe.model, recipe.memory, recipe.data.clustering.branching)
    if recipe.model.init_from and latest is None:
        source = ckpt.load_anchor(model, recipe.model.init_from)
        _log(f"anchor initialised from {source.path} (step {source.step})", rank)
    mem = recipe.memory
    if mem.freeze_anchor:
        for p in model.anchor_parameters():
            p.requires_grad_(False)
    if recipe.parallel.activation_checkpointing:
        model.set_activation_checkpointing(True)
    n_params = count_parameters(model)
    if recipe.model.type == "hf" and meta["vocab_size"] > model.vocab_size:
        raise RecipeError("data.tokenizer.path", f"the tokenizer has {meta['vocab_size']} tokens but "
                          f"{recipe.model.pretrained} has {model.vocab_size}; use the model's own tokenizer")
    model.to(device)
    memory_llama = mem.is_memory_llama  # Titans memories inside the model; no bank
    if memory_llama:
        for line in model.describe():
            _log(line, rank)
    bank = None
    if mem.enabled:
        from memtrain.model.hierarchical import generic_mask
        from memtrain.parallel.bank import MemoryBank, level_sizes_line

        joint = joint_clipping(recipe, prec)
        if joint and prec != "fp32" and recipe.parallel.zero_stage == 0:
            raise LaunchError(f"memory.grad_clip joint under ZeRO 0 needs fp32 DeepSpeed gradients, but this run is "
                              f"{prec}; set parallel.zero_stage to 1-3, or memory.grad_clip: separate")
        if mem.bank == "sharded":
            from memtrain.parallel.sharded_bank import ShardedMemoryBank

            subtree_ranks = None
            if recipe.data.placement == "affine":  # a subtree's rows live on the ranks that read it
                from memtrain.data.loader import affine_subtree_ranks

                subtree_ranks = affine_subtree_ranks(recipe, world)
            bank = ShardedMemoryBank(model.memory_layout, device, seed=recipe.run.seed, mode=mem.bank_optimizer,
                                     subtree_ranks=subtree_ranks,
                                     dtype=torch.bfloat16 if mem.bank_dtype == "bf16" else torch.float32,
                                     compute_dtype=torch.bfloat16 if prec == "bf16" else torch.float32,
                                     offload=mem.bank_offload)
        else:
            bank = MemoryBank(model.memory_layout, device, seed=recipe.run.seed)
        o = recipe.train.optimizer
        bank.build_optimizer(mem.optimizer.lr, tuple(o.betas), o.eps, mem.optimizer.weight_decay)
        memory_schedule = lr_at(recipe, "memory")
        # The generic draws have their own generator (saved per rank): the global RNG is also consumed
        # by whatever creates DataLoader iterators, which a resumed run does at other times.
        generic_rng = torch.Generator().manual_seed(recipe.run.seed * 1_000_003 + rank)
        kind = mem.bank + (f", {mem.bank_dtype} rows" + (", offloaded to CPU" if mem.bank_offload else "")
                           if mem.bank == "sharded" else "")
        _log(level_sizes_line(model.memory_layout) + f" | {kind} bank ({mem.bank_optimizer} AdamW)"
             + f" | generic memory p={recipe.generic_prob:.4f}"
             + f" | clipping {'joint' if joint else 'separate'}" + (" | anchor frozen" if mem.freeze_anchor else ""),
             rank)

    universal = False
    if latest is not None:
        saved = ckpt.read_trainer_state(latest)
        ckpt.check_compatible(latest, saved, recipe, world)
        if ckpt.needs_universal(latest, saved, recipe, world):
            # The partitioned optimizer state was written for another data-parallel size or ZeRO stage:
            # DeepSpeed's universal checkpoint re-partitions it for this one.
            _log(f"{latest.path} was written by {latest.world_size} rank(s) with ZeRO stage "
                 f"{((saved.get('recipe') or {}).get('parallel') or {}).get('zero_stage')}; converting it to a "
                 "universal checkpoint", rank)
            ckpt.ensure_universal(latest, rank)
            universal = True
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()

    engine, optimizer, scheduler = initialize(model, recipe, world, prec, load_universal=universal)
    joint_norm = None
    if bank is not None and joint and recipe.parallel.zero_stage > 0:
        from memtrain.parallel.engine import JointNorm

        joint_norm = JointNorm(engine, recipe.train.grad_clip)  # DeepSpeed clips the anchor by the joint norm
    from memtrain.parallel.comm import AnchorCommCounter

    anchor_comm = AnchorCommCounter(engine)  # comm/anchor_bytes_*: DeepSpeed's collectives (nothing with 1 rank)
    train_batches = LoaderIterator(build_loader(recipe, "train", recipe.train.micro_batch_size))
    val_factory = None
    if meta.get("val_samples", 0) > 0:
        val_loader = build_loader(recipe, "val", recipe.train.micro_batch_size, shuffle=False)
        val_factory = lambda: iter(val_loader)  # noqa: E731 - a fresh pass from the start each time

    step, tokens_seen = 0, 0
    # Per-rank RNG streams, distinct across ranks (restored from the checkpoint on resume).
    torch.manual_seed(recipe.run.seed + 1 + rank)
    if latest is not None:
        _, incomplete = ckpt.list_checkpoints(run_dir)
        for p in incomplete:
            _log(f"ignoring incomplete checkpoint {p} (no {ckpt.MARKER})", rank)
        state, rank_state = ckpt.load(engine, latest, rank, universal=universal)
        if bank is not None:
            ckpt.load_bank(bank, latest.path)
            if "generic_rng" in rank_state:
                generic_rng.set_state(rank_state["generic_rng"])
        step, tokens_seen = int(state["step"]), int(state["tokens_seen"])
        # Global placement: one position for all ranks. Affine: each rank's own, in its subtrees.
        affine = recipe.data.placement == "affine"
        train_batches.load_state_dict(rank_state["loader"] if affine else state["loader"])
        _log(f"resuming from {latest.path} (step {step}, {tokens_seen} tokens seen)", rank)
    if rank == 0:  # only once the checkpoint has loaded: a failed resume leaves the run as it was
        (run_dir / "recipe.yaml").write_text(recipe.to_yaml(), encoding="utf-8")

    max_steps = recipe.max_steps
    log_every = recipe.steps(recipe.logging.every_steps)
    ckpt_every = recipe.steps(recipe.checkpoint.every_steps)
    eval_every = recipe.steps(recipe.train.eval.every_steps)
    writer = MetricsWriter(run_dir, enabled=rank == 0, tensorboard=recipe.logging.tensorboard,
                           resume_step=step if latest is not None else None)
    if recipe.model.type == "hf":  # 6N for a pretrained model whose shape the recipe does not describe
        fpt = 6.0 * count_parameters(model.hf_model)
    elif recipe.model.type == "titans":
        from memtrain.model.flops import titans_flops_per_token

        fpt = titans_flops_per_token(model, recipe.model)
    else:
        fpt = flops_per_token(recipe.model, recipe.data.seq_len)
    if bank is not None:  # the fetched memory's matmuls, forward and backward
        fpt += 6 * model.memory_layout.fetched_parameters
    peak = recipe.logging.peak_flops or peak_flops(device)
    schedule = lr_at(recipe)
    n_memory = sum(p.numel() for p in model.memory_parameters()) if bank is not None else 0
    params = f"{n_params - n_memory:,} parameters" + (f" + {n_memory:,} generic memory" if n_memory else "")
    if memory_llama:
        params += f" ({sum(p.numel() for p in model.parameters() if p.requires_grad):,} trainable)"
        memory_schedule, lora_schedule = lr_at(recipe, "memory"), lr_at(recipe, "lora")
        lora_trains = any(p.requires_grad for p in model.lora_parameters())
    _log(f"{params} | {world} rank(s) via {dist_env.launcher} on {device.type} ({prec}) | "
         f"ZeRO {recipe.parallel.zero_stage} | {recipe.sequences_per_step} x {recipe.data.seq_len} tokens per step "
         f"= {recipe.train.micro_batch_size} per micro-batch x {world} ranks x {accum} accumulation", rank)
    if writer.log_dir:
        _log(f"TensorBoard logs in {writer.log_dir} (tensorboard --logdir {run_dir / 'tensorboard'})", rank)

    def save(at_step: int) -> None:
        loader_state = train_batches.state_dict()
        write_bank = None
        if bank is not None:  # replicated: rank 0 writes it; sharded: every rank its rows
            write_bank = lambda path: ckpt.save_bank(bank, path, rank)  # noqa: E731
        path = ckpt.save(engine, recipe, step=at_step, rank=rank, world_size=world,
                         trainer_state={"step": at_step, "tokens_seen": tokens_seen,
                                        "loader": loader_state, "world_size": world},
                         rank_extra={"loader": loader_state,
                                     **({"generic_rng": generic_rng.get_state()} if bank is not None else {})},
                         write_extra=write_bank)
        _log(f"saved checkpoint {path}", rank)

    if step >= max_steps:
        _log(f"run already complete at step {step} (train.max_steps {max_steps}); nothing to do", rank)
        writer.close()
        return {"step": step, "tokens_seen": tokens_seen, "resumed": True}

    stop = _StopFlag()
    stop.install()
    last: dict = {}
    engine.train()
    last_saved = step if latest is not None else -1
    try:
        while step < max_steps:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            t_start = time.perf_counter()
            anchor_comm.reset()  # evaluation and checkpoints between steps are not charged to this one
            data_wait, pre_clip_norm = 0.0, float("nan")
            loss_sum = torch.zeros((), device=device)
            for _ in range(accum):
                t0 = time.perf_counter()
                batch = _to_device(_next_batch(train_batches), device)
                data_wait += time.perf_counter() - t0
                memory = None
                if bank is not None:
                    # Generic memory with probability 1/(k+1) per sequence (Section 4).
                    generic = generic_mask(batch["input_ids"].shape[0], recipe.generic_prob, generic_rng)
                    memory = bank.fetch(batch["cluster_ids"], generic.to(device))
                out = engine(batch["input_ids"], doc_ids=batch["doc_ids"], memory=memory)
                loss = lm_loss(out.logits, batch["labels"])
                if out.aux_loss is not None:
                    loss = loss + out.aux_loss
                engine.backward(loss)
                boundary = engine.is_gradient_accumulation_boundary()
                if boundary:
                    if bank is not None:
                        bank.reduce_gradients()
                        bank_norm = clip_memory(engine, bank, recipe, joint, joint_norm)
                        pre_clip_norm = bank_norm["total"]
                    elif recipe.parallel.zero_stage == 0:
                        # DeepSpeed reports no norm without ZeRO or bf16; take it before clipping here.
                        grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
                        pre_clip_norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
                engine.step()
                if boundary and joint_norm is not None:  # ZeRO 1-3: DeepSpeed clipped the anchor by the joint norm
                    bank_norm = clip_memory_after_step(bank, joint_norm, bank_norm)
                    pre_clip_norm = bank_norm["total"]
                loss_sum += loss.detach()
            if bank is not None:
                bank.step(memory_schedule(step))
            step += 1
            tokens_seen += recipe.tokens_per_step
            grad_norm = global_grad_norm(engine)
            if math.isnan(grad_norm) or (bank is not None and joint):
                grad_norm = pre_clip_norm  # ZeRO 0: DeepSpeed reports none; joint: anchor and bank together
            train_loss = _all_mean([float(loss_sum) / accum], device)[0]
            step_time = time.perf_counter() - t_start
            data_frac = _all_mean([data_wait / step_time], device)[0]

            values = {
                "loss/train": train_loss,
                "optim/lr": schedule(step - 1),
                "optim/grad_norm": grad_norm,
                "throughput/tokens_per_sec": recipe.tokens_per_step / step_time,
                "throughput/device/tokens_per_sec": recipe.tokens_per_step / step_time / world,
                "throughput/step_time_s": step_time,
                "throughput/data_wait_frac": data_frac,
                "progress/tokens_seen": float(tokens_seen),
            }
            values.update(anchor_comm.stats())
            if bank is not None:
                logging_now = step % log_every == 0 or step == max_steps
                values.update(bank.stats(norms=logging_now))
                values["memory_module/grad_norm"] = bank_norm["bank"]
                values["optim/memory_lr"] = memory_schedule(step - 1)
            if memory_llama:
                # The base model does not train: optim/lr is the memory blocks' learning rate.
                values["optim/lr"] = values["optim/memory_lr"] = memory_schedule(step - 1)
                if lora_trains:
                    values["optim/lora_lr"] = lora_schedule(step - 1)
                if step % log_every == 0 or step == max_steps:
                    # Section 4.2.2's gate / contribution / ||W_h|| statistics of the last training micro-batch
                    # (before evaluation runs forwards of its own); rank 0's batch, like the other stats.
                    values.update(model.gate_stats())
            if peak:
                values["throughput/mfu"] = fpt * values["throughput/device/tokens_per_sec"] / peak
            if device.type == "cuda":
                values["gpu_mem/max_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            if eval_every and step % eval_every == 0 or step == max_steps:
                val = evaluate(engine, val_factory, recipe.train.eval.batches, device, bank)
                if val is not None:
                    values["loss/val"] = val
                if bank is not None:
                    val_generic = evaluate(engine, val_factory, recipe.train.eval.batches, device, bank, "generic")
                    if val_generic is not None:
                        values["loss/val_generic"] = val_generic
            if step % log_every == 0 or step == max_steps or "loss/val" in values:
                writer.scalars(step, values)
                writer.line(format_line(step, max_steps, values))
            last = {"step": step, "tokens_seen": tokens_seen, **values}

            stopping = _any(stop.raised, device)
            if (ckpt_every and step % ckpt_every == 0) or step == max_steps or stopping:
                save(step)
                last_saved = step
            if stopping:
                _log(f"stopped by signal at step {step}; run the same command to resume", rank)
                break
    finally:
        stop.restore()
        writer.close()
    last["resumed"] = latest is not None
    last["last_checkpoint_step"] = last_saved
    return last


__all__ = ["train", "evaluate", "eval_memory", "clip_memory", "lm_loss"]
