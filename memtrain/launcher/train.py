"""The training loop: `memtrain train RECIPE [key=value ...]`.

One optimizer step = ``grad_accum`` micro-batches on every rank, together ``train.global_batch_tokens``
tokens. DeepSpeed owns the forward/backward/step mechanics (ZeRO, precision, clipping, gradient
averaging); this loop owns data, evaluation, logging, checkpoints and resume.

Resume is automatic: running the same command again continues from the newest complete checkpoint in
``run.dir`` and reproduces the uninterrupted loss trajectory (model, optimizer, scheduler, data-loader
position and every rank's RNG state are restored). SIGTERM or SIGUSR1 (Slurm preemption) make the
loop finish the current step, write a checkpoint and exit cleanly.

The objective does not depend on how many ranks run it. The loss of a step is the mean over every
scored token of the global batch (token-weighted across micro-batches and ranks, as in Megatron and
torchtitan): each micro-batch's summed token loss is scaled by ``accum * world / tokens_in_step``, so
that DeepSpeed's averaging over accumulation steps and ranks yields the global mean. The generic-memory
draw is a hash of each sequence's global sample index and the step (not a per-rank stream), and
validation is token-weighted over a selection of the val split that is the same on any world size
(:class:`memtrain.data.loader.ValidationSet`). So 1, 2 or 3 ranks take the same steps, and a run
resumes on another world size as it would have continued.

Integrity. Before any engine starts: the data is checked against the recipe and its shard checksums
are verified (split over the ranks); rank 0 holds ``<run.dir>/run.lock`` for the run's life, so a
second trainer on the same run directory refuses; the checkpoint to resume from is verified against
the checksums in its ``COMPLETE.json``. During training a step whose loss or gradient norm is not
finite on any rank is skipped by every rank (no update; counted in ``loss/nonfinite_steps``), and
``train.max_nonfinite_steps`` of them in a row stop the run with :class:`memtrain.errors.DivergenceError`
(exit code 3) naming the last good checkpoint. A checkpoint is never written from non-finite weights.

``memory.type: memory_llama`` (Titans memories inside a frozen Hugging Face Llama) has no memory bank:
the memory blocks and LoRA adapters are ordinary parameter groups of DeepSpeed's optimizer, each on its
own learning rate (``optim/memory_lr``, ``optim/lora_lr``); logged steps add the blocks' gate,
contribution and weight-norm statistics (``memory_module/*``). Every forward starts each sample from a
reset memory (the blocks' ``auto`` mode), validation included.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import socket
import time
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

from memtrain.config import CUDAGRAPH_MODES, Recipe, RecipeError
from memtrain.errors import (CheckpointError, CollectiveError, DivergenceError, LaunchError, is_path_failure,
                             is_storage_failure, path_line)
from memtrain.parallel import dist
from memtrain.launcher.console import library_output, set_library_log_levels
from memtrain.launcher.metrics import ATTEMPTS, MetricsWriter, append_jsonl, format_line
from memtrain.model.switches import check_kernels


IGNORE_INDEX = -100  # labels the loss skips (memtrain.data.loader.IGNORE_INDEX, cross_entropy's default)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token loss of one batch (labels ``IGNORE_INDEX`` are not scored)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=IGNORE_INDEX)


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed token loss of one batch, in fp32 (the numerator of a token-weighted mean)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def output_loss_sum(out, labels: torch.Tensor) -> torch.Tensor:
    """The summed token loss of a forward's output: the model's own ``loss_sum`` (it was given the labels:
    the fused loss, :func:`configure_model`) or :func:`token_loss_sum` of its logits."""
    return out.loss_sum if out.loss_sum is not None else token_loss_sum(out.logits, labels)


def label_kwargs(model, batch: dict) -> dict:
    """``labels=`` for models that compute their loss themselves (decoder and Titans; not ``hf``)."""
    return {"labels": batch["labels"]} if hasattr(model, "set_fused_loss") else {}


def _new_cudagraph_step(module, args) -> None:
    """A forward pre-hook on a model whose compiled blocks replay as CUDA graphs: every forward (one micro-batch, or
    one evaluation batch) starts a new generation of the graphs' outputs, whose memory the next replays may reuse
    (``torch.compiler.cudagraph_mark_step_begin``); the previous forward's have been consumed by then (its
    backward ran, or it was evaluation)."""
    torch.compiler.cudagraph_mark_step_begin()


def configure_model(model, recipe: Recipe, device: torch.device) -> dict:
    """Apply the recipe's training options to ``model`` (before DeepSpeed): activation checkpointing
    (parallel.activation_checkpointing: none, every block or every n-th), the fused loss
    (train.loss_chunk_tokens; decoder and Titans models) and regional compilation of the blocks
    (model.compile, in model.compile_mode: with reduce-overhead and max-autotune every compiled block's forward
    and backward replay as CUDA graphs on a GPU, a new generation per forward of the model). Returns what was
    applied (``checkpoint_every``, ``loss_chunk_tokens``, ``compiled_blocks``, ``compile_mode``) for
    :func:`training_options_line`."""
    from memtrain.config import checkpoint_every, compile_enabled

    every = checkpoint_every(recipe.parallel.activation_checkpointing)
    if every:
        model.set_activation_checkpointing(every)
    chunk = 0
    if hasattr(model, "set_fused_loss"):
        chunk = recipe.train.loss_chunk_tokens
        model.set_fused_loss(chunk)
    compiled, mode = 0, recipe.model.compile_mode
    if compile_enabled(recipe, device.type):
        compiled = model.compile_blocks(**({} if mode == "default" else {"mode": mode}))
        if compiled and mode in CUDAGRAPH_MODES:
            model.register_forward_pre_hook(_new_cudagraph_step)
    return {"checkpoint_every": every, "loss_chunk_tokens": chunk, "compiled_blocks": compiled,
            "compile_mode": mode if compiled else None}


def training_options_line(options: dict, n_layers: Optional[int]) -> str:
    """``compiled blocks ... | activation checkpointing ... | loss ...`` for the start of a run."""
    every, chunk, compiled = options["checkpoint_every"], options["loss_chunk_tokens"], options["compiled_blocks"]
    if not every:
        ckpt = "none"
    elif every == 1:
        ckpt = "every block"
    else:
        count = f" ({len(range(0, n_layers, every))} of {n_layers})" if n_layers else ""
        ckpt = f"1 in {every} blocks{count}"
    loss = f"fused, chunks of {chunk} tokens" if chunk else "full logits"
    mode = options.get("compile_mode") or "default"
    how = "regional" if mode == "default" else f"regional, mode {mode}" + (
        ": CUDA graphs on a GPU" if mode in CUDAGRAPH_MODES else "")
    blocks = f"{compiled} block(s) compiled (torch.compile, {how})" if compiled else "eager blocks"
    return f"{blocks} | activation checkpointing {ckpt} | loss {loss}"


def compile_seconds() -> float:
    """Seconds this process has spent in torch.compile (Dynamo frames and their backward graphs)."""
    try:
        from torch._dynamo.utils import calculate_time_spent

        spent = calculate_time_spent()
    except Exception:  # an internal API: report nothing rather than fail a run
        return float("nan")
    return float(spent.get("entire_frame_compile", 0.0)) + float(spent.get("entire_backward_compile", 0.0))


def scored_tokens(labels: torch.Tensor) -> int:
    return int((labels != IGNORE_INDEX).sum())


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


class StepClock:
    """Wall time per part of a step (forward, backward, optimizer), summed over its micro-batches. With
    ``sync`` on a GPU each mark waits for the device first, so the parts are the device's time, not the
    launch time; without it (unlogged steps) nothing waits.

    ``host`` holds, per part, the time until the part's Python code returned, before the mark waited for the
    device: with ``sync`` on a GPU, a part whose host time is well below its time is device-bound; one whose host
    time is about its time is host-bound (or its queue of launches was full, which blocks the host too). On CPU,
    or without ``sync``, the two are the same."""

    def __init__(self, device: torch.device, sync: bool) -> None:
        self.sync = sync and device.type == "cuda"
        self.device = device
        self.seconds = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        self.host = dict(self.seconds)
        self.t = time.perf_counter()

    def start(self) -> None:
        if self.sync:
            torch.cuda.synchronize(self.device)
        self.t = time.perf_counter()

    def mark(self, part: str) -> None:
        self.host[part] += time.perf_counter() - self.t
        if self.sync:
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.seconds[part] += now - self.t
        self.t = now


def _all_sum(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(t)
    return t.tolist()


def _all_mean(values: list[float], device: torch.device) -> list[float]:
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    return [v / world for v in _all_sum(values, device)]


def _any(flag: bool, device: torch.device) -> bool:
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item())


def to_device(batch: dict, device: torch.device) -> dict:
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
def evaluate(engine, val_set, device: torch.device, bank=None, memory: str = "fetched") -> Optional[float]:
    """Validation loss: the summed token loss of every rank's share of ``val_set`` (an iterable of
    micro-batches, re-iterated from the start each call: :class:`memtrain.data.loader.ValidationSet`)
    over the number of scored tokens, on all ranks; the same on any world size. ``memory`` as in
    :func:`eval_memory` when the model has memories."""
    if val_set is None:
        return None
    engine.eval()
    total, count = 0.0, 0
    module = getattr(engine, "module", engine)
    for batch in val_set:
        batch = to_device(batch, device)
        out = engine(batch["input_ids"], doc_ids=batch["doc_ids"], memory=eval_memory(bank, batch, memory),
                     **label_kwargs(module, batch))
        total += float(output_loss_sum(out, batch["labels"]))
        count += scored_tokens(batch["labels"])
    engine.train()
    total, count = _all_sum([total, float(count)], device)
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
    """Run (or resume) training to ``train.max_steps``; returns a summary of the last step.

    Everything a user can get wrong is checked before the run directory is touched: the recipe, the
    prepared data against it, the shards' checksums, the run lock. The lock is released on every exit."""
    from memtrain.data.loader import recipe_meta
    from memtrain.data.verify import check_recipe_data
    from memtrain.parallel import checkpoint as ckpt
    from memtrain.parallel.engine import precision

    dist_env = dist.discover()
    device = dist.resolve_device(recipe.run.device, dist_env)
    prec = precision(recipe, device)
    accum = recipe.grad_accum_steps(dist_env.world_size)  # RecipeError before anything is written
    check_kernels(recipe, device)
    meta = recipe_meta(recipe)  # DataError when `memtrain prepare` has not run
    if recipe.model.type != "hf" and meta["vocab_size"] > recipe.model.vocab_size:
        raise RecipeError("model.vocab_size", f"{recipe.model.vocab_size} is smaller than the tokenizer's "
                          f"{meta['vocab_size']} tokens in {recipe.data_dir}")
    check_recipe_data(recipe, meta)  # memories on unclustered data, another tree: before any engine starts
    run_dir = recipe.run_dir
    latest = ckpt.latest_checkpoint(run_dir)
    if latest is not None and not recipe.checkpoint.resume:
        raise CheckpointError(f"{run_dir} already holds checkpoints (newest {latest.tag}) and checkpoint.resume "
                              "is false; resume it, or choose a new run.dir")

    # A preemption signal may arrive at any moment, start-up included: from here on it only sets the flag
    # the loop checks after each step. Helper processes must survive it (they get it too under srun).
    stop = _StopFlag()
    stop.install()
    _start_resource_tracker_ignoring_signals()
    # Start-up (data checksums, a universal conversion by rank 0) may keep ranks apart for minutes: the
    # long timeout until the loop starts, the short one per step (the hang guard).
    dist.init(dist_env, device, recipe.parallel.backend, timeout_minutes=recipe.parallel.checkpoint_timeout_minutes)
    rank, world = dist_env.rank, dist_env.world_size
    attempt: dict = {}
    try:
        if recipe.data.verify:
            _verify_data(recipe, rank, world, device)
        created = not run_dir.exists()
        lock = _lock_run_dir(run_dir, rank, device)
        state = "failed"
        try:
            summary = _train(recipe, dist_env, device, prec, accum, meta, stop, attempt)
            state = "preempted" if summary.get("stopped") else "complete"
            return summary
        except DivergenceError:
            state = "diverged"
            raise
        finally:
            if attempt.get("started") and rank == 0:
                try:
                    _record_attempt(run_dir, {"event": "end", "time": time.time(), "state": state,
                                              "step": attempt.get("step")})
                except OSError:  # a full disk, say: the run's own error comes first; `memtrain status` shows no end
                    pass
            if lock is not None:
                lock.release()
                if created:  # a run that failed before writing anything leaves no run directory (rmdir: only if empty)
                    try:
                        run_dir.rmdir()
                    except OSError:
                        pass
    except OSError as e:
        if not is_storage_failure(e):
            raise
        raise _storage_error(e, recipe) from None
    except RuntimeError as e:
        if world > 1 and dist.is_collective_failure(e):
            raise CollectiveError(
                f"rank {rank}: a collective did not complete ({str(e).strip().splitlines()[0][:200]}): another rank "
                f"is hung or has died (parallel.timeout_minutes {recipe.parallel.timeout_minutes} per training step, "
                f"{recipe.parallel.checkpoint_timeout_minutes} around checkpoints); see the other ranks' output. "
                "Running the same command again resumes from the last complete checkpoint") from None
        raise
    finally:
        stop.restore()


def _storage_error(e: OSError, recipe: Recipe) -> Exception:
    """The one-line error for a write to the run directory the file system refused (full, over quota, read-only:
    :func:`memtrain.errors.is_storage_failure`), rather than a traceback: the file, the cause, the space left and
    the checkpoint the same command resumes from. A save's own failures are memtrain.parallel.checkpoint's."""
    from memtrain.errors import StorageError
    from memtrain.parallel.checkpoint_folder import free_bytes, latest_checkpoint

    run_dir = recipe.run_dir
    where = e.filename or f"to run.dir {run_dir}"
    free = free_bytes(run_dir if run_dir.exists() else run_dir.parent)
    space = f"; its file system has {free / 2**20:,.1f} MiB free" if free != float("inf") else ""
    last = latest_checkpoint(run_dir, strict=False)
    resume = (f"Running the same command resumes from {last.path} (step {last.step})" if last is not None else
              "Running the same command starts the run")
    return StorageError(f"writing {where} failed: {e.strerror or e}{space}. {resume} once the storage is fixed (free "
                        "space, or move run.dir to another disk)")


def _record_attempt(run_dir, event: dict) -> None:
    """Append one start or end event to ``<run.dir>/attempts.jsonl`` (rank 0): `memtrain status` counts
    restarts and tells how each attempt ended (complete, preempted, diverged, failed). On a line of its own
    (:func:`memtrain.launcher.metrics.append_jsonl`): a record torn by a crash does not swallow the next one."""
    append_jsonl(run_dir / ATTEMPTS, event)


def _start_resource_tracker_ignoring_signals() -> None:
    """Start multiprocessing's resource tracker (mosaicml-streaming's shared memory registers with it)
    with SIGUSR1 ignored: Slurm delivers the preemption signal to every process of the job step, and a
    tracker killed by it made every later unregister print a KeyError traceback. (It ignores SIGINT and
    SIGTERM itself; an ignored signal stays ignored across its exec.)"""
    from multiprocessing import resource_tracker

    try:
        previous = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    except ValueError:  # not the main thread: leave it to start as it would
        return
    try:
        resource_tracker.ensure_running()
    finally:
        signal.signal(signal.SIGUSR1, previous)


def _verify_data(recipe: Recipe, rank: int, world: int, device: torch.device) -> None:
    """Every rank hashes its share of the prepared shards; any damage is one DataError on every rank."""
    from memtrain.data.loader import data_location
    from memtrain.data.verify import damaged, verify_shards

    root, remote = data_location(recipe)
    if remote:  # shards arrive on demand; Streaming checks what it downloads
        return
    t0 = time.perf_counter()
    problems = verify_shards(root, rank=rank, world=world)
    found = dist.gather_strings(problems)
    if found:
        raise damaged(root, found)
    _log(f"data checksums verified in {time.perf_counter() - t0:.1f} s", rank)


def _allocation(error: RuntimeError) -> str:
    """The size torch's allocator could not get, from its message ("you tried to allocate 68719476736 bytes")."""
    import re

    found = re.search(r"allocate (\d+) bytes", str(error))
    return f"one tensor of {int(found.group(1)) / 2**30:.1f} GiB" if found else str(error).splitlines()[0][:200]


def _available_gib() -> float:
    import psutil

    return psutil.virtual_memory().available / 2**30


def routing_notes(recipe: Recipe) -> list[str]:
    """The start-of-run notes for routed cross-attention memory: under sequence routing, the default (eq. 8 as
    the crossattn-memory-banks paper writes it) and an easy one to get by accident when turning routing on
    (``top_k``), that it is not causal; with ``top_k`` 1, that the language-model loss does not train the
    router (:mod:`memtrain.model.crossattn.routing`). Empty otherwise."""
    c = recipe.memory.crossattn
    if not (recipe.memory.is_crossattn and c is not None and c.top_k):
        return []
    notes = []
    if c.routing == "sequence":
        # memtrain's decoder routes each document of a packed row; a pretrained model's attention crosses them
        pooled = "each whole training sequence" if recipe.model.type == "hf" else "each document of a training sequence"
        notes.append(f"note: sequence routing pools {pooled}, the tokens every position predicts included, so the "
                     "router sees the future and the language-model loss is optimistic; memory.crossattn.routing: "
                     "token is causal (Section 4.4)")
    if c.top_k == 1:
        notes.append("note: with memory.crossattn.top_k 1 every token reads one chapter, whose router weight cancels "
                     "in that read's softmax, so the language-model loss gives the router no gradient: it learns from "
                     "the load-balancing loss alone (memory.crossattn.balance_loss); top_k 2 or more lets the loss "
                     "train it")
    return notes


def _lock_run_dir(run_dir, rank: int, device: torch.device):
    """Rank 0 takes the run directory's lock; a refusal is raised on every rank. Returns the lock (rank 0)."""
    from memtrain.parallel.run_lock import RunLock

    lock, refusal = None, ""
    if rank == 0:
        try:
            lock = RunLock(run_dir)
            lock.acquire()
        except LaunchError as e:
            lock, refusal = None, str(e)
        except OSError as e:  # run.dir this user may not create or write: every rank stops with the same line
            if not is_path_failure(e):
                raise
            lock, refusal = None, path_line(e)
    refusal = (dist.gather_strings([refusal]) or [""])[0]
    if refusal:
        raise LaunchError(refusal)
    if lock is not None and lock.replaced:
        _log(lock.replaced, rank)  # a crashed run's lock (dead pid, or this Slurm job's earlier incarnation)
    return lock


def _finite_weights(engine, bank, device: torch.device) -> bool:
    from memtrain.parallel.engine import weights_finite

    ok = weights_finite(engine) and (bank is None or all(bool(torch.isfinite(t).all()) for t in bank.parameters()))
    return not _any(not ok, device)


class Banks(NamedTuple):
    """The memory banks that live outside DeepSpeed (:func:`build_banks`): ``bank`` (hierarchical memories,
    replicated or row-sharded), ``chapter_bank`` (a sharded cross-attention bank), whether they are clipped
    jointly with the anchor, and their learning-rate schedule."""

    bank: Any
    chapter_bank: Any
    joint: bool
    memory_schedule: Optional[Callable[[int], float]]

    @property
    def stepped(self) -> Any:
        """The bank the loop reduces, clips, steps and saves (at most one of the two exists)."""
        return self.bank if self.bank is not None else self.chapter_bank


def check_compiled_alignment(module, latest) -> None:
    """Refuse to run compiled blocks over a parameter that does not start 16 bytes aligned: the blocks share
    their compiled code, whose kernels assume the alignment the first block's parameters had, and a block
    whose parameter sits off it faults with "CUDA error: misaligned address" in its first step
    (:func:`memtrain.parallel.engine.split_for_alignment`). New runs are aligned; a run resumed from a
    checkpoint written before memtrain aligned its parameter groups keeps that checkpoint's layout."""
    from memtrain.parallel.engine import ALIGN_BYTES, misaligned_parameters

    bad = misaligned_parameters(module)
    if bad:
        name, offset = bad[0]
        cause = "DeepSpeed's flat buffer put it there"
        if latest is not None:
            cause = (f"checkpoint {latest.path} was written with its optimizer groups uncut (before memtrain aligned "
                     "them) and this run keeps that layout")
        raise LaunchError(f"model.compile: {len(bad)} parameter(s) do not start {ALIGN_BYTES}-byte aligned ({name} is "
                          f"{offset} bytes off; {cause}), and compiled blocks would fault on them with 'CUDA error: "
                          "misaligned address'; set model.compile=false for this run")


def build_banks(model, recipe: Recipe, device: torch.device, prec: str, world: int) -> Banks:
    """The recipe's banks for ``model``, as the trainer builds them; call on every rank before
    ``model.to(device)`` and before DeepSpeed (a sharded cross-attention bank replaces the model's banks by
    parameter-less views, so ZeRO never sees it and the whole bank never reaches the GPU)."""
    from memtrain.parallel.engine import joint_clipping, lr_at

    mem = recipe.memory
    if mem.is_crossattn and mem.crossattn is not None and mem.crossattn.bank == "sharded":
        from memtrain.parallel.chapter_bank import chapter_bank_joint_clipping, shard_crossattn_banks

        chapter_bank = shard_crossattn_banks(model, recipe, device)
        # bank_lr's warmup and cosine, 0 from freeze_bank_at
        return Banks(None, chapter_bank, chapter_bank_joint_clipping(recipe, prec), lr_at(recipe, "bank"))
    if not mem.enabled:
        return Banks(None, None, False, None)
    from memtrain.parallel.bank import MemoryBank

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
    return Banks(bank, None, joint, lr_at(recipe, "memory"))


def training_flops_per_token(model, recipe: Recipe) -> float:
    """Model FLOPs per trained token behind ``throughput/mfu``: 6N for a pretrained model (``model.type hf``,
    whose shape the recipe does not describe), Titans' own count, else the anchor's formula; plus the
    fetched hierarchical memory's matmuls (6 per fetched parameter, forward and backward) and the
    cross-attention memory layers (:func:`memtrain.model.flops.crossattn_flops_per_token`)."""
    from memtrain.model import count_parameters, flops_per_token

    if recipe.model.type == "hf":
        fpt = 6.0 * count_parameters(model.hf_model)
    elif recipe.model.type == "titans":
        from memtrain.model.flops import titans_flops_per_token

        fpt = titans_flops_per_token(model, recipe.model)
    else:
        fpt = flops_per_token(recipe.model, recipe.data.seq_len)
    if recipe.memory.enabled:
        fpt += 6 * model.memory_layout.fetched_parameters
    if getattr(model, "crossattn", None) is not None:  # cross-attention memory layers (from scratch or adapters)
        from memtrain.model.flops import crossattn_flops_per_token

        fpt += crossattn_flops_per_token(model.crossattn, recipe.train.micro_batch_size, recipe.data.seq_len)
    return fpt


def _train(recipe: Recipe, dist_env, device: torch.device, prec: str, accum: int, meta: dict, stop: "_StopFlag",
           attempt: dict) -> dict:
    """The run itself (see :func:`train`). ``attempt`` receives ``started`` once the run directory is
    written to, and the ``step`` reached."""
    from memtrain.data.loader import LoaderIterator, ValidationSet, build_loader
    from memtrain.model import build, count_parameters, peak_flops
    from memtrain.parallel import checkpoint as ckpt
    from memtrain.parallel.checkpoint_folder import write_text_atomic
    from memtrain.parallel.engine import (bank_frozen_from, flattens, global_grad_norm, initialize, lr_at,
                                         skipped_step)

    rank, world = dist_env.rank, dist_env.world_size
    run_dir = recipe.run_dir
    latest = ckpt.latest_checkpoint(run_dir)  # again, now under the lock
    saved: dict = {}
    if latest is not None:
        saved = ckpt.read_trainer_state(latest)
        ckpt.check_compatible(latest, saved, recipe, world)
        ckpt.check_precision(latest, saved, prec)
        ckpt.check_token_durations(latest, saved, recipe)
        ckpt.verify(latest, rank, world)  # the files against COMPLETE.json's checksums, before anything reads them
        done = int(saved.get("step", latest.step))
        if done >= recipe.max_steps:
            # Before anything touches run.dir: a command that trains nothing records no recipe (its overrides never
            # trained), no attempt (`memtrain status` would count a restart), no metrics or TensorBoard file, no
            # universal conversion. The run lock alone came and went.
            _log(f"run already complete at step {done} (train.max_steps {recipe.max_steps}, checkpoint "
                 f"{latest.path}); nothing to do", rank)
            return {"step": done, "tokens_seen": int(saved.get("tokens_seen", 0)), "resumed": True}
        ckpt.check_same_data(latest, saved, meta, recipe.data.remote or recipe.data_dir)
    if rank == 0:  # saves a failure or a kill cut short: no save is in progress under the lock, so their space returns
        for old in ckpt.leftovers(run_dir):
            shutil.rmtree(old, ignore_errors=True)
            _log(f"removed {old.name}, left by a save or a prune that did not finish", rank)
    verbose = recipe.logging.verbose
    with library_output(verbose):
        import deepspeed  # noqa: F401  (DeepSpeed's import speaks on some machines)
    set_library_log_levels(verbose)  # rank 0's console: memtrain's lines (logging.verbose shows the libraries')

    torch.manual_seed(recipe.run.seed)  # identical initial weights on every rank
    try:
        model = build(recipe.model, recipe.memory, recipe.data.clustering.branching)
    except RuntimeError as e:  # torch's CPU allocator: "DefaultCPUAllocator: can't allocate memory: ..."
        if "can't allocate memory" not in str(e):
            raise
        raise LaunchError(f"building the model ran out of host memory ({_allocation(e)}; "
                          f"{_available_gib():.1f} GiB available); `memtrain recipe show RECIPE` counts its "
                          "parameters: make the memory smaller (memory.crossattn.tokens, memory.levels) or "
                          "row-shard it over the ranks (memory.crossattn.bank: sharded, memory.bank: sharded)"
                          ) from None
    if recipe.model.init_from and latest is None:
        source = ckpt.load_anchor(model, recipe.model.init_from, rank, world,  # ranks share the checksums
                                  log=lambda line: _log(line, rank))
        _log(f"anchor initialised from {source.path} (step {source.step})", rank)
    mem = recipe.memory
    if mem.freeze_anchor:
        for p in model.anchor_parameters():
            p.requires_grad_(False)
    options = configure_model(model, recipe, device)  # checkpointing, fused loss, compiled blocks
    n_params = count_parameters(model)
    if recipe.model.type == "hf" and meta["vocab_size"] > model.vocab_size:
        raise RecipeError("data.tokenizer.path", f"the tokenizer has {meta['vocab_size']} tokens but "
                          f"{recipe.model.pretrained} has {model.vocab_size}; use the model's own tokenizer")
    banks = build_banks(model, recipe, device, prec, world)  # before .to(device): a sharded bank stays off the GPU
    bank, chapter_bank, joint, memory_schedule = banks.bank, banks.chapter_bank, banks.joint, banks.memory_schedule
    model.to(device)
    memory_llama = mem.is_memory_llama  # Titans memories inside the model; no bank
    crossattn = getattr(model, "crossattn", None)  # cross-attention memory layers (memory.type crossattn)
    if crossattn is not None:
        crossattn_schedules = (lr_at(recipe, "memory"), lr_at(recipe, "bank"))
        counts = crossattn.parameter_counts()
        _log(f"cross-attention memory: {counts['layers']} layer(s) {crossattn.layer_indices}, variant "
             f"{mem.crossattn.variant}, {counts['banks']} bank(s) of {mem.crossattn.tokens} tokens "
             f"({counts['bank']:,} bank parameters, {counts['per_layer']:,} per layer)"
             + (f", {mem.crossattn.chapters} chapters, top-{mem.crossattn.top_k} per {mem.crossattn.routing}"
                if mem.crossattn.top_k else ""), rank)
        for note in routing_notes(recipe):
            _log(note, rank)
    if hasattr(model, "describe"):  # MemoryLlama, memory adapters: what trains at which rate; Titans: its attention
        for line in model.describe():
            _log(line, rank)
    if bank is not None:
        from memtrain.model.hierarchical import generic_mask
        from memtrain.parallel.bank import level_sizes_line

        kind = mem.bank + (f", {mem.bank_dtype} rows" + (", offloaded to CPU" if mem.bank_offload else "")
                           if mem.bank == "sharded" else "")
        _log(level_sizes_line(model.memory_layout) + f" | {kind} bank ({mem.bank_optimizer} AdamW)"
             + f" | generic memory p={recipe.generic_prob:.4f}"
             + f" | clipping {'joint' if joint else 'separate'}" + (" | anchor frozen" if mem.freeze_anchor else ""),
             rank)
    if chapter_bank is not None:  # fetched inside the forward; reduced, clipped, stepped here like `bank`
        _log(chapter_bank.describe() + f" | clipping {'joint' if joint else 'separate'}", rank)
    step_bank = banks.stepped  # the bank the loop reduces, steps and saves

    universal = False
    aligned = True  # a new run cuts its parameter groups for aligned flat buffers (memtrain.parallel.engine)
    if latest is not None:  # read, checked and verified above
        aligned = ckpt.param_groups_aligned(saved)  # the layout the checkpoint's optimizer state was written in
        if ckpt.needs_universal(latest, saved, recipe, world):
            # The partitioned optimizer state was written for another data-parallel size or ZeRO stage:
            # DeepSpeed's universal checkpoint re-partitions it for this one.
            _log(f"{latest.path} was written by {latest.world_size} rank(s) with ZeRO stage "
                 f"{((saved.get('recipe') or {}).get('parallel') or {}).get('zero_stage')}; converting it to a "
                 "universal checkpoint", rank)
            ckpt.ensure_universal(latest, rank)
            universal = True

    with library_output(verbose):  # DeepSpeed's optimizer prints its memory (MA ... Max_MA ...) here
        aligned = aligned and flattens(recipe, prec)  # ZeRO 0 in fp32: torch's AdamW, nothing flattened or cut
        engine, optimizer, scheduler = initialize(model, recipe, world, prec, load_universal=universal, align=aligned)
    if options["compiled_blocks"] and device.type == "cuda":
        check_compiled_alignment(engine.module, latest)
    joint_norm = None
    if step_bank is not None and joint and recipe.parallel.zero_stage > 0:
        from memtrain.parallel.engine import JointNorm

        joint_norm = JointNorm(engine, recipe.train.grad_clip)  # DeepSpeed clips the anchor by the joint norm
    from memtrain.parallel.comm import AnchorCommCounter

    anchor_comm = AnchorCommCounter(engine)  # comm/anchor_bytes_*: DeepSpeed's collectives (nothing with 1 rank)
    train_batches = LoaderIterator(build_loader(recipe, "train", recipe.train.micro_batch_size))
    val_set = None
    if meta.get("val_samples", 0) > 0:
        val_set = ValidationSet(recipe, recipe.train.micro_batch_size, rank, world, recipe.train.eval.batches)

    step, tokens_seen, nonfinite_total, nonfinite_run = 0, 0, 0, 0
    # Per-rank RNG streams, distinct across ranks (restored from the checkpoint on resume).
    torch.manual_seed(recipe.run.seed + 1 + rank)
    if latest is not None:
        _, incomplete = ckpt.list_checkpoints(run_dir)
        for p in incomplete:
            _log(f"ignoring incomplete checkpoint {p} (no {ckpt.MARKER})", rank)
        for d in ckpt.damaged_checkpoints(run_dir):  # older than `latest` (a newer one stopped the run at the start)
            _log(f"keeping damaged checkpoint {d.path} ({d.problem}): older than {latest.tag}, never resumed from "
                 f"or pruned; delete it, or its {ckpt.MARKER} for the retention to remove it", rank)
        with library_output(verbose):
            state, rank_state = ckpt.load(engine, latest, rank, universal=universal)
        if step_bank is not None:
            ckpt.load_bank(step_bank, latest.path)
        step, tokens_seen = int(state["step"]), int(state["tokens_seen"])
        nonfinite_total, nonfinite_run = int(state.get("nonfinite_steps", 0)), int(state.get("nonfinite_run", 0))
        # Global placement: one position for all ranks. Affine: each rank's own, in its subtrees.
        affine = recipe.data.placement == "affine"
        train_batches.load_state_dict(rank_state["loader"] if affine else state["loader"])
        _log(f"resuming from {latest.path} (step {step}, {tokens_seen} tokens seen)", rank)
    if rank == 0:  # only once the checkpoint has loaded: a failed resume leaves the run as it was
        write_text_atomic(run_dir / "recipe.yaml", recipe.to_yaml())  # a full disk leaves no half file
        restarts = os.environ.get("SLURM_RESTART_COUNT")
        _record_attempt(run_dir, {"event": "start", "time": time.time(), "host": socket.gethostname(),
                                  "pid": os.getpid(), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
                                  "slurm_restart_count": int(restarts) if restarts and restarts.isdigit() else None,
                                  "world_size": world, "resumed_from_step": step if latest is not None else None})
    attempt.update(started=True, step=step)

    max_steps = recipe.max_steps
    log_every = recipe.steps(recipe.logging.every_steps)
    ckpt_every = recipe.steps(recipe.checkpoint.every_steps)
    eval_every = recipe.steps(recipe.train.eval.every_steps)
    max_nonfinite = recipe.train.max_nonfinite_steps
    # Rows an earlier attempt logged past the checkpoint resumed from (all of them without one) go.
    writer = MetricsWriter(run_dir, enabled=rank == 0, tensorboard=recipe.logging.tensorboard, resume_step=step)
    fpt = training_flops_per_token(model, recipe)
    peak = recipe.logging.peak_flops or peak_flops(device)
    schedule = lr_at(recipe)
    n_memory = sum(p.numel() for p in model.memory_parameters()) if bank is not None else 0
    params = f"{n_params - n_memory:,} parameters" + (f" + {n_memory:,} generic memory" if n_memory else "")
    lora_trains = False  # LoRA adapters at their own learning rate (memory_llama, crossattn memory adapters)
    if memory_llama or (mem.is_crossattn and hasattr(model, "lora_parameters")):
        params += f" ({sum(p.numel() for p in model.parameters() if p.requires_grad):,} trainable)"
        lora_trains = any(p.requires_grad for p in model.lora_parameters())
        lora_schedule = lr_at(recipe, "lora") if lora_trains else None
    if memory_llama:
        memory_schedule = lr_at(recipe, "memory")
    _log(f"{params} | {world} rank(s) via {dist_env.launcher} on {device.type} ({prec}) | "
         f"ZeRO {recipe.parallel.zero_stage} | {recipe.sequences_per_step} x {recipe.data.seq_len} tokens per step "
         f"= {recipe.train.micro_batch_size} per micro-batch x {world} ranks x {accum} accumulation", rank)
    n_layers = len(model.blocks) if isinstance(getattr(model, "blocks", None), torch.nn.ModuleList) else None
    _log(training_options_line(options, n_layers), rank)
    compiled = options["compiled_blocks"] > 0
    compile_base = compile_seconds() if compiled else 0.0
    if compiled:
        _log("the first step (and the first evaluation) includes compiling the blocks; time/compile_s counts it", rank)
    if writer.log_dir:
        _log(f"TensorBoard logs in {writer.log_dir} (tensorboard --logdir {run_dir / 'tensorboard'})", rank)

    def save(at_step: int) -> None:
        nonlocal lead_warned
        if not _finite_weights(engine, step_bank, device):
            good = ckpt.latest_checkpoint(run_dir, strict=False)
            raise DivergenceError(f"the weights are not finite at step {at_step} (the loss and gradient norms were); "
                                  f"no checkpoint was written. {_last_good(good, recipe)}")
        loader_state = train_batches.state_dict()
        write_bank = None
        if step_bank is not None:  # replicated: rank 0 writes it; sharded: every rank its rows
            write_bank = lambda path: ckpt.save_bank(step_bank, path, rank)  # noqa: E731
        dist.set_timeout(recipe.parallel.checkpoint_timeout_minutes)  # one rank may write for a while
        t_save = time.perf_counter()
        with library_output(verbose):
            path = ckpt.save(engine, recipe, step=at_step, rank=rank, world_size=world,
                             trainer_state={"step": at_step, "tokens_seen": tokens_seen, "loader": loader_state,
                                            "world_size": world, "nonfinite_steps": nonfinite_total,
                                            "nonfinite_run": nonfinite_run, ckpt.ALIGNED_KEY: aligned,
                                            ckpt.PRECISION_KEY: prec,
                                            ckpt.DATA_KEY: ckpt.data_identity(meta)},
                             rank_extra={"loader": loader_state}, write_extra=write_bank)
        dist.set_timeout(recipe.parallel.timeout_minutes)
        _log(f"saved checkpoint {path}", rank)
        if in_slurm_job and not lead_warned:  # once per attempt: the first save that needs more than Slurm allows
            warning = signal_lead_warning(time.perf_counter() - t_save, last_step_s, recipe.slurm.signal_seconds)
            if warning:
                lead_warned = True
                _log(warning, rank)

    in_slurm_job = bool(os.environ.get("SLURM_JOB_ID"))
    lead_warned = False
    last_step_s = 0.0

    dist.set_timeout(recipe.parallel.timeout_minutes)  # the hang guard, per step (save() lengthens it)

    last: dict = {}
    first_step = step
    bank_freeze = bank_frozen_from(recipe) if crossattn is not None else None  # memory.crossattn.freeze_bank_at
    engine.train()
    last_saved = step if latest is not None else -1
    zero0 = recipe.parallel.zero_stage == 0
    try:
        while step < max_steps:
            if bank_freeze is not None and step >= bank_freeze:  # from this step on, or resumed past it
                crossattn.freeze_bank_gradients()
                if chapter_bank is not None:
                    chapter_bank.requires_grad_(False)
                _log(f"step {step}: the cross-attention bank and its W_K, W_V are frozen from here on "
                     f"(memory.crossattn.freeze_bank_at): no gradient, no update", rank)
                bank_freeze = None
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            t_start = time.perf_counter()
            anchor_comm.reset()  # evaluation and checkpoints between steps are not charged to this one
            pre_clip_norm, bank_norm, skip = float("nan"), None, False
            # time/* split of logged steps: on a GPU the clock waits for the device at those steps only
            split = StepClock(device, (step + 1) % log_every == 0 or step + 1 == max_steps)
            # The whole step's micro-batches first: the loss is normalised by the scored tokens of the
            # global batch, which one all-reduce of the counts gives before the first backward.
            micro = [to_device(_next_batch(train_batches), device) for _ in range(accum)]
            data_wait = time.perf_counter() - t_start
            step_tokens = _all_sum([float(sum(scored_tokens(b["labels"]) for b in micro))], device)[0]
            scale = accum * world / max(step_tokens, 1.0)
            ce_parts, aux_parts = [], []
            for batch in micro:
                split.start()
                memory = None
                if bank is not None:
                    # Generic memory with probability 1/(k+1) per sequence (Section 4), drawn per sample.
                    generic = generic_mask(batch["sample_index"], step, recipe.run.seed, recipe.generic_prob)
                    memory = bank.fetch(batch["cluster_ids"], generic.to(device))
                out = engine(batch["input_ids"], doc_ids=batch["doc_ids"], memory=memory, **label_kwargs(model, batch))
                ce = output_loss_sum(out, batch["labels"])
                loss = ce * scale  # DeepSpeed divides by accum and averages over ranks: the global token mean
                ce_parts.append(ce.detach())
                if out.aux_loss is not None:
                    loss = loss + out.aux_loss
                    aux_parts.append(out.aux_loss.detach())
                split.mark("forward")
                engine.backward(loss)
                split.mark("backward")
                boundary = engine.is_gradient_accumulation_boundary()
                if boundary:
                    if step_bank is not None:
                        step_bank.reduce_gradients()
                        bank_norm = clip_memory(engine, step_bank, recipe, joint, joint_norm)
                        pre_clip_norm = bank_norm["total"]
                    elif zero0:
                        # DeepSpeed reports no norm without ZeRO or bf16; take it before clipping here.
                        grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
                        pre_clip_norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
                    local = float(torch.stack(ce_parts + aux_parts).sum())
                    bad = not math.isfinite(local) or (zero0 and not math.isfinite(pre_clip_norm)) or (
                        bank_norm is not None and not math.isfinite(bank_norm["bank"]))
                    skip = _any(bad, device)  # agreed: every rank skips, or none
                if boundary and skip:
                    with skipped_step(engine):
                        engine.step()
                else:
                    engine.step()
                if boundary and joint_norm is not None and not skip:
                    # ZeRO 1-3: DeepSpeed clipped the anchor by the joint norm
                    bank_norm = clip_memory_after_step(step_bank, joint_norm, bank_norm)
                    pre_clip_norm = bank_norm["total"]
                split.mark("optimizer")
            # DeepSpeed's own overflow check (ZeRO 1-3, bf16) can skip a step whose losses were finite.
            applied = engine.was_step_applied()
            nonfinite = skip or not applied
            if not applied and engine.lr_scheduler is not None:
                engine.lr_scheduler.step()  # the schedule follows the step count, skipped steps included
            split.start()
            if step_bank is not None:
                if nonfinite:
                    step_bank.skip_step()
                else:
                    step_bank.step(memory_schedule(step))
            split.mark("optimizer")
            step += 1
            attempt["step"] = step
            tokens_seen += recipe.tokens_per_step
            nonfinite_total += int(nonfinite)
            nonfinite_run = nonfinite_run + 1 if nonfinite else 0
            grad_norm = global_grad_norm(engine)
            if math.isnan(grad_norm) or (step_bank is not None and joint):
                grad_norm = pre_clip_norm  # ZeRO 0: DeepSpeed reports none; joint: anchor and bank together
            if nonfinite and not zero0:
                grad_norm = float("nan")  # DeepSpeed computed none for a skipped step (its value would be stale)
            step_time = time.perf_counter() - t_start
            last_step_s = step_time
            ce_sum, aux_sum, data_frac = _all_sum(
                [float(torch.stack(ce_parts).sum()), float(torch.stack(aux_parts).sum()) if aux_parts else 0.0,
                 data_wait / step_time], device)
            # The LM loss alone, as loss/val; the routers' load-balancing term it was trained with apart (it was
            # included in loss/train until 2026-11-30, 0.01-0.02 nats at the default weight)
            train_loss = ce_sum / max(step_tokens, 1.0)

            values = {
                "loss/train": train_loss,
                **({"loss/balance": aux_sum / (accum * world)} if aux_parts else {}),
                "loss/nonfinite_steps": float(nonfinite_total),
                "optim/lr": schedule(step - 1),
                "optim/grad_norm": grad_norm,
                "throughput/tokens_per_sec": recipe.tokens_per_step / step_time,
                "throughput/device/tokens_per_sec": recipe.tokens_per_step / step_time / world,
                "throughput/step_time_s": step_time,
                "throughput/data_wait_frac": data_frac / world,
                "time/data_s": data_wait,
                **{f"time/{part}_s": seconds for part, seconds in split.seconds.items()},
                **{f"time/host_{part}_s": seconds for part, seconds in split.host.items()},
                "progress/tokens_seen": float(tokens_seen),
            }
            values.update(anchor_comm.stats())
            if step_bank is not None:
                logging_now = step % log_every == 0 or step == max_steps
                values.update(step_bank.stats(norms=logging_now))
                values["memory_module/grad_norm"] = bank_norm["bank"]
                values["optim/memory_lr"] = memory_schedule(step - 1)
            if memory_llama:
                # The base model does not train: optim/lr is the memory blocks' learning rate.
                values["optim/lr"] = values["optim/memory_lr"] = memory_schedule(step - 1)
                if step % log_every == 0 or step == max_steps:
                    # Section 4.2.2's gate / contribution / ||W_h|| statistics of the last training micro-batch
                    # (before evaluation runs forwards of its own); rank 0's batch, like the other stats.
                    values.update(model.gate_stats())
            if crossattn is not None:
                values["optim/memory_lr"] = crossattn_schedules[0](step - 1)
                values["optim/bank_lr"] = crossattn_schedules[1](step - 1)
                # Chapter usage of the step's forwards on this rank (entropy, dead chapters, router loss).
                values.update(crossattn.pop_stats())
            if lora_trains:
                values["optim/lora_lr"] = lora_schedule(step - 1)
            if peak:
                values["throughput/mfu"] = fpt * values["throughput/device/tokens_per_sec"] / peak
            if device.type == "cuda":
                values["gpu_mem/max_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            if eval_every and step % eval_every == 0 or step == max_steps:
                val = evaluate(engine, val_set, device, bank)
                if val is not None:
                    values["loss/val"] = val
                if bank is not None:
                    val_generic = evaluate(engine, val_set, device, bank, "generic")
                    if val_generic is not None:
                        values["loss/val_generic"] = val_generic
            if compiled:
                values["time/compile_s"] = compile_seconds() - compile_base  # this process's, so far
                if step == first_step + 1:
                    _log(f"compiled {options['compiled_blocks']} block(s): {values['time/compile_s']:.1f} s "
                         f"of step {step}'s {step_time:.1f} s", rank)
            if step % log_every == 0 or step == max_steps or "loss/val" in values or nonfinite:
                writer.scalars(step, values)
                line = format_line(step, max_steps, values)
                writer.line(line + (" | non-finite: step skipped" if nonfinite else ""))
            last = {"step": step, "tokens_seen": tokens_seen, **values}
            if nonfinite_run >= max_nonfinite:
                raise DivergenceError(
                    f"training diverged: the loss or gradient norm was not finite at steps {step - nonfinite_run + 1}"
                    f"-{step} ({nonfinite_run} in a row, train.max_nonfinite_steps {max_nonfinite}); their updates "
                    f"were skipped. {_last_good(ckpt.latest_checkpoint(run_dir, strict=False), recipe)}")

            stopping = _any(stop.raised, device)
            if (ckpt_every and step % ckpt_every == 0) or step == max_steps or stopping:
                if nonfinite_run and not stopping:
                    # Weights a streak of skipped steps left in place are finite but lead nowhere: keep_last
                    # must not prune the checkpoints before the streak for them. (A preemption still saves.)
                    _log(f"no checkpoint at step {step}: the last {nonfinite_run} step(s) were not finite", rank)
                else:
                    save(step)
                    last_saved = step
            if stopping:
                if step < max_steps:
                    last["stopped"] = True
                    _log(f"stopped by signal at step {step} (checkpoint written); run the same command to resume",
                         rank)
                break
    finally:
        writer.close()
    last["resumed"] = latest is not None
    last["last_checkpoint_step"] = last_saved
    return last


def signal_lead_warning(save_s: float, step_s: float, signal_seconds: int) -> Optional[str]:
    """The warning for a Slurm job whose checkpoint takes too long for ``slurm.signal_seconds``, or None. On
    Slurm's warning before the time limit (``--signal=B:USR1@signal_seconds``) the run finishes its step and
    saves; when that needs more than half the lead (``step_s + save_s``), a slower save or a slow node leaves the
    job killed at the limit mid-save, and the steps since the last checkpoint are lost."""
    needed = save_s + step_s
    if needed <= signal_seconds / 2:
        return None
    suggest = int(math.ceil(2 * needed / 10.0)) * 10
    return (f"a checkpoint took {save_s:.1f} s to save, after steps of {step_s:.1f} s: a stop on Slurm's warning "
            f"({signal_seconds} s before the time limit, slurm.signal_seconds) needs about {needed:.0f} s of it, so "
            f"the job may be killed at the limit in the middle of the save and lose the steps since the last "
            f"checkpoint; set slurm.signal_seconds to {suggest} or more for the next submission")


def _last_good(info, recipe: Recipe) -> str:
    if recipe.memory.is_memory_llama:  # the base is frozen; its own learning rates are fixed for a run
        return ("Lower memory.memory_llama.memory_lr or memory.memory_llama.lora_lr (or raise "
                "train.schedule.warmup, lower train.grad_clip) and start a new run.dir: MemoryLlama's learning "
                "rates cannot change on resume" + (f" (the last good checkpoint is {info.path}, step {info.step})"
                                                   if info is not None else ""))
    lr = "train.optimizer.lr"
    if recipe.memory.type != "none":  # memories train at their own learning rate, which may be the one too high
        lr += " or memory.optimizer.lr"
    if recipe.memory.crossattn is not None and recipe.memory.crossattn.bank_lr is not None:
        lr += " or memory.crossattn.bank_lr"
    if info is None:
        return (f"No checkpoint was written before; lower {lr} (or raise train.schedule.warmup, lower "
                "train.grad_clip) and start again")
    return (f"The last good checkpoint is {info.path} (step {info.step}); lower {lr} (or raise "
            "train.schedule.warmup, lower train.grad_clip) and run again to resume from it, or start a new run.dir")


__all__ = ["train", "evaluate", "eval_memory", "clip_memory", "configure_model", "lm_loss", "output_loss_sum",
           "token_loss_sum"]
