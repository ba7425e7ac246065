"""DeepSpeed engine set-up from a recipe.

The DeepSpeed JSON config is generated here from the recipe and never written by hand
(:func:`deepspeed_config`); ``memtrain recipe show`` prints it. The optimizer is torch's AdamW over
parameter groups (weight decay on matrices and embeddings, none on norm gains), handed to DeepSpeed
as a client optimizer so that ZeRO shards its state; the learning-rate schedule is a client
``LambdaLR`` that DeepSpeed steps once per optimizer step and saves in its checkpoints.

Schedule (hierarchical-memories paper, Appendix A.1): linear warmup to ``lr`` over the warmup steps,
then a cosine from ``lr`` down to the cool-down floor ``min_lr`` reached at ``train.max_steps``.
Every parameter group has a ``role`` (``anchor``, ``memory``, ``lora``, ``bank``) with its own peak and floor
(:func:`peak_lr`) on that shared warmup and cosine. With ``memory.type: memory_llama`` the base model
is frozen and the groups are the memory blocks (role ``memory``, memory.memory_llama.memory_lr) and
the LoRA adapters (role ``lora``, memory.memory_llama.lora_lr), each split into decayed matrices and
undecayed vectors (and the identity-initialised W_x); gradient clipping is DeepSpeed's
(train.grad_clip) over all of them together.

Aligned parameters (:func:`split_for_alignment`). Where DeepSpeed flattens (ZeRO 1-2, and its bf16
optimizer) it concatenates each group's parameters into one buffer and makes every parameter a view at
its running offset, so one parameter whose size is not a multiple of 8 elements (titans-170m-mac's
12-head memory gate bias: 36) shifts every later one off the 16-byte boundary. Compiled blocks share
their compiled code, whose Triton kernels assume the alignment the first block's parameters had (Inductor
treats parameters as static inputs and does not re-check their alignment at run time); a later block
whose parameters sit 8 bytes off then faults with "CUDA error: misaligned address". So a group is cut
after every such parameter: each piece is flattened into its own buffer, and every parameter starts
16-byte aligned (:func:`misaligned_parameters` checks). Groups of models without such parameters are
unchanged; a resumed run keeps the layout its checkpoint was written with (``param_groups_aligned`` in
the trainer state). DeepSpeed 0.19's ``zero_optimization.parameter_alignment`` pads between parameters
in its ZeRO 1-2 optimizer but not in the ``BF16_Optimizer`` it picks for ZeRO 1 with bf16 parameters and
fp32 gradient accumulation (the paper recipes' setting); cutting the groups aligns both.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from memtrain.config import Recipe
from memtrain.errors import LaunchError


def precision(recipe: Recipe, device: torch.device) -> str:
    """``bf16`` on GPU and ``fp32`` on CPU unless the recipe says otherwise."""
    wanted = recipe.parallel.precision
    if wanted == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    if wanted == "bf16" and device.type != "cuda":
        raise LaunchError("parallel.precision is bf16 but this run is on CPU; use parallel.precision=fp32 "
                          "or auto")
    return wanted


def deepspeed_config(recipe: Recipe, world_size: int, precision_name: str = "fp32",
                     load_universal: bool = False) -> dict:
    """The DeepSpeed config for ``world_size`` data-parallel ranks. ``load_universal``: the checkpoint
    to resume from is a DeepSpeed universal checkpoint (converted because the data-parallel size or the
    ZeRO stage changed; :func:`memtrain.parallel.checkpoint.ensure_universal`)."""
    accum = recipe.grad_accum_steps(world_size)
    stage = recipe.parallel.zero_stage
    zero: dict = {"stage": stage}
    if stage > 0:
        zero.update({"contiguous_gradients": True, "overlap_comm": False,
                     "reduce_bucket_size": 5e7, "allgather_bucket_size": 5e7})
    if stage == 3:
        zero.update({"stage3_gather_16bit_weights_on_model_save": False, "stage3_param_persistence_threshold": 1e5})
    return {
        "train_batch_size": recipe.sequences_per_step,
        "train_micro_batch_size_per_gpu": recipe.train.micro_batch_size,
        "gradient_accumulation_steps": accum,
        # Joint clipping with the memory bank under ZeRO 0 is done by the training loop over both; under
        # ZeRO 1-3 DeepSpeed clips the anchor by the joint norm (JointNorm).
        "gradient_clipping": 0.0 if joint_clipping(recipe, precision_name) and stage == 0 else recipe.train.grad_clip,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": precision_name == "bf16"},
        "fp16": {"enabled": False},
        # Accumulate bf16 gradients in fp32 so that many micro-batches do not lose precision (ZeRO 1-3; DeepSpeed
        # refuses the mix without ZeRO, where its bf16 optimizer keeps fp32 masters and bf16 gradients).
        "data_types": {"grad_accum_dtype": "fp32" if precision_name == "bf16" and stage > 0 else None},
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
        "dump_state": False,
        # memtrain writes TensorBoard itself; DeepSpeed's monitors would duplicate the tags.
        "tensorboard": {"enabled": False},
        "csv_monitor": {"enabled": False},
        "wandb": {"enabled": False},
        "checkpoint": {"load_universal": bool(load_universal)},
    }


def joint_clipping(recipe: Recipe, precision_name: str) -> bool:
    """Anchor and memory gradients clipped by one global norm over both. ZeRO 0 (fp32): the training loop
    scales the DeepSpeed module's plain ``.grad`` tensors and the bank; ZeRO 1-3 (any precision):
    DeepSpeed clips the anchor by the joint norm through :class:`JointNorm`, the loop the bank. ``auto``
    picks joint wherever one of these holds (everywhere but bf16 under ZeRO 0); an explicit ``joint``
    there is refused by the loop."""
    m = recipe.memory
    if not m.enabled or recipe.train.grad_clip <= 0 or m.grad_clip == "separate":
        return False
    if m.grad_clip == "joint":
        return True
    return recipe.parallel.zero_stage > 0 or precision_name == "fp32"


class JointNorm:
    """Joint clipping of the anchor and the memory bank under ZeRO 1-3.

    DeepSpeed's ZeRO optimizers compute the anchor's global gradient norm (over its partitions and ranks)
    inside ``step()`` and clip by ``min(1, clip / (norm + 1e-6))``: ZeRO 1/2 in ``scaled_global_norm()``,
    ZeRO 3 by combining ``_get_norm_groups()`` (an L2 norm over per-group norms). This wraps that method
    on the optimizer instance so the norm DeepSpeed clips by is ``sqrt(anchor^2 + bank^2)`` (times the
    loss scale, 1 in fp32/bf16): ZeRO 1/2 get the joint value, ZeRO 3 one more group norm, the bank's.
    The training loop sets :attr:`bank_norm` before ``engine.step()`` and afterwards scales the bank by
    :meth:`coefficient`, the same factor. An invalid norm (inf/NaN, DeepSpeed's negative sentinel)
    passes through unchanged and leaves the bank unscaled (DeepSpeed skips or fails that step).

    ZeRO 1 with bf16 parameters and fp32 gradient accumulation (the paper recipes' setting) runs DeepSpeed's
    ``BF16_Optimizer``, whose norm is that of the tensors ``get_grads_for_norm()`` returns (on every rank all
    of the anchor's gradients, no reduction over data-parallel ranks), and whose clip scales the tensors
    ``get_grads_for_norm(for_clipping=True)`` returns by ``clip / (norm + 1e-6)``: one more tensor holding
    the bank's norm makes that norm the joint one (its total is read back from ``_global_grad_norm``).
    Until 2026-11-30 this case raised a TypeError at the start of training, so memory recipes with the
    default ``memory.grad_clip: auto`` under ZeRO 1 in bf16 could not start on a GPU."""

    def __init__(self, engine, clip: float):
        opt = engine.optimizer
        self._opt, self.clip = opt, clip
        self.bank_norm = 0.0
        self.total: Optional[float] = None
        if hasattr(opt, "scaled_global_norm"):  # ZeRO 1/2
            self._inner = opt.scaled_global_norm
            opt.scaled_global_norm = self._norm  # an instance attribute shadows the method
        elif hasattr(opt, "_get_norm_groups"):  # ZeRO 3
            self._inner = opt._get_norm_groups
            opt._get_norm_groups = self._norm_groups
        elif hasattr(opt, "get_grads_for_norm") and hasattr(opt, "clear_hp_grads"):  # BF16_Optimizer: ZeRO 1, bf16
            self._inner = opt.get_grads_for_norm
            opt.get_grads_for_norm = self._grads_for_norm
        else:
            raise TypeError(f"joint clipping under ZeRO needs DeepSpeed's ZeRO optimizer, got {type(opt).__name__}")

    def _scale(self) -> float:
        return float(getattr(self._opt, "loss_scale", 1.0))

    def _norm(self, *args, **kwargs):
        scaled = self._inner(*args, **kwargs)
        value = float(scaled)
        if not math.isfinite(value) or value < 0:
            self.total = float("nan")
            return scaled
        self.total = math.sqrt((value / self._scale()) ** 2 + self.bank_norm ** 2)
        return torch.as_tensor(self.total * self._scale(), dtype=scaled.dtype, device=scaled.device)

    def _norm_groups(self, *args, **kwargs):
        groups = list(self._inner(*args, **kwargs))
        values = [float(g) for g in groups]
        if any(not math.isfinite(v) or v < 0 for v in values):
            self.total = float("nan")
            return groups
        self.total = math.sqrt(sum((v / self._scale()) ** 2 for v in values) + self.bank_norm ** 2)
        like = next((g for g in groups if torch.is_tensor(g)), None)
        extra = self.bank_norm * self._scale()
        return groups + [torch.tensor(extra, dtype=like.dtype, device=like.device) if like is not None else extra]

    def _grads_for_norm(self, for_clipping: bool = False):
        out = self._inner(for_clipping=for_clipping)
        if for_clipping:  # scaled in place by the clip: the anchor's gradients
            return out
        anchor, experts = out
        self.total = None  # read back from the optimizer after its step (:meth:`coefficient`)
        device = anchor[0].device if anchor else torch.device("cpu")
        return [*anchor, torch.tensor([self.bank_norm], dtype=torch.float32, device=device)], experts

    def coefficient(self) -> float:
        """The clipping factor DeepSpeed applied to the anchor in the step just taken."""
        if self.total is None and hasattr(self._opt, "_global_grad_norm"):  # BF16_Optimizer: the joint norm
            norm = self._opt._global_grad_norm
            self.total = float(norm) if norm is not None else None
            if self.total is not None and (not math.isfinite(self.total) or self.total < 0):
                self.total = float("nan")
        if self.total is None or not math.isfinite(self.total):
            return 1.0
        return min(1.0, self.clip / (self.total + 1e-6))


def param_groups(model: nn.Module, weight_decay: float, memory: Optional[list] = None,
                 memory_weight_decay: float = 0.0, bank: Optional[list] = None,
                 lora: Optional[list] = None) -> list[dict]:
    """Weight decay on every matrix (and the embedding), none on vectors such as norm gains. Memory
    parameters (``memory``, e.g. the generic memory) form their own group with their own decay (none on
    their vectors either), cross-attention banks (``bank``: the latent tokens and their W_K, W_V) one
    more, and LoRA adapters on a frozen base (``lora``, memory adapters) one more, decayed like the anchor;
    the ``role`` key tells the schedule which learning rate a group follows."""
    skip = {id(p) for p in (memory or []) + (bank or []) + (lora or [])}
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad and id(p) not in skip:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = []
    if decay:
        groups.append({"params": decay, "weight_decay": weight_decay, "role": "anchor"})
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0, "role": "anchor"})
    for params, role in ((memory, "memory"), (bank, "bank"), (lora, "lora")):
        mats = [p for p in params or [] if p.requires_grad and p.ndim >= 2]
        vecs = [p for p in params or [] if p.requires_grad and p.ndim < 2]
        if mats:
            decay_of = weight_decay if role == "lora" else memory_weight_decay
            groups.append({"params": mats, "weight_decay": decay_of, "role": role})
        if vecs:
            groups.append({"params": vecs, "weight_decay": 0.0, "role": role})
    return groups


# DeepSpeed's flat buffers: a parameter is 16-byte aligned when the elements before it in its group are a
# multiple of this (16 bytes of bf16 / fp16; 32 of fp32).
FLAT_ALIGN_ELEMENTS = 8
ALIGN_BYTES = 16  # what Inductor's generated kernels assume of an aligned input (GPU_ALIGN_BYTES)


def split_for_alignment(groups: list[dict], multiple: int = FLAT_ALIGN_ELEMENTS) -> list[dict]:
    """Cut every group after each parameter whose size is not a multiple of ``multiple`` elements; the
    pieces keep the group's settings and the parameters their order. Flattened one buffer per group, every
    parameter then starts ``multiple`` elements past an aligned start (see the module docstring)."""
    out = []
    for group in groups:
        piece: list = []
        for p in group["params"]:
            piece.append(p)
            if p.numel() % multiple:
                out.append({**group, "params": piece})
                piece = []
        if piece:
            out.append({**group, "params": piece})
    return out


def flattens(recipe: Recipe, precision_name: str) -> bool:
    """Whether DeepSpeed flattens the parameter groups into buffers (ZeRO 1-3, or bf16 / fp16): then
    :func:`split_for_alignment` applies. ZeRO 0 in fp32 steps torch's AdamW on the parameters themselves."""
    return recipe.parallel.zero_stage > 0 or precision_name != "fp32"


def misaligned_parameters(module: nn.Module, align: int = ALIGN_BYTES) -> list[tuple[str, int]]:
    """``(name, address modulo align)`` of every parameter of ``module`` that does not start on an ``align``-byte
    boundary (a view at an odd offset of a flat buffer)."""
    return [(name, p.data_ptr() % align) for name, p in module.named_parameters() if p.data_ptr() % align]


def build_optimizer(model: nn.Module, recipe: Recipe, align: bool = False) -> torch.optim.Optimizer:
    """AdamW over :func:`param_groups` (or MemoryLlama's), each group at its role's peak lr; ``align``: groups
    cut by :func:`split_for_alignment`."""
    o = recipe.train.optimizer
    if recipe.memory.is_memory_llama:
        # Frozen base: only the memory blocks (role memory) and the LoRA adapters (role lora) train.
        ml = _memory_llama(recipe)
        groups = model.param_groups(ml.memory_lr, ml.lora_lr, ml.weight_decay)
    else:
        memory = model.memory_parameters() if hasattr(model, "memory_parameters") else []
        bank = model.bank_parameters() if hasattr(model, "bank_parameters") else []
        lora = model.lora_parameters() if recipe.memory.is_crossattn and hasattr(model, "lora_parameters") else []
        groups = param_groups(model, o.weight_decay, memory, recipe.memory.optimizer.weight_decay, bank, lora)
    if align:
        groups = split_for_alignment(groups)
    for g in groups:
        g["lr"] = peak_lr(recipe, g["role"])[0]
    if not groups:
        raise LaunchError("nothing to train: every parameter is frozen")
    return torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, foreach=False)


def _memory_llama(recipe: Recipe):
    from memtrain.config import MemoryLlamaConfig

    return recipe.memory.memory_llama or MemoryLlamaConfig()


ROLES = ("anchor", "memory", "lora", "bank")


def peak_lr(recipe: Recipe, role: str = "anchor") -> tuple[float, float]:
    """``(peak, floor)`` learning rates of a parameter-group role.

    - ``anchor``: train.optimizer.lr -> train.schedule.min_lr;
    - ``memory``: memory.optimizer.lr -> memory.optimizer.min_lr (hierarchical memories, Appendix A.2),
      or, with memory.type memory_llama, memory.memory_llama.memory_lr -> min_lr_ratio x memory_lr;
    - ``lora`` (memory_llama): memory.memory_llama.lora_lr -> min_lr_ratio x lora_lr; (crossattn memory
      adapters): memory.crossattn.lora_lr -> the fraction memory.optimizer.min_lr / lr of it;
    - ``bank`` (memory.type crossattn: the banks and their W_K, W_V): memory.crossattn.bank_lr (default
      memory.optimizer.lr) -> the same fraction of it as memory.optimizer.min_lr is of its lr.
    """
    if role not in ROLES:
        raise ValueError(f"unknown parameter-group role {role!r}; expected one of {', '.join(ROLES)}")
    if role == "anchor":
        return recipe.train.optimizer.lr, recipe.train.schedule.min_lr
    if recipe.memory.is_memory_llama:
        ml = _memory_llama(recipe)
        lr = ml.memory_lr if role == "memory" else ml.lora_lr
        return lr, lr * ml.min_lr_ratio
    o = recipe.memory.optimizer
    if role == "lora":
        c = recipe.memory.crossattn
        if not recipe.memory.is_crossattn or c is None or c.lora is None:
            raise ValueError("role 'lora' (LoRA adapters at their own learning rate) needs memory.type memory_llama "
                             "or crossattn with memory.crossattn.lora")
        return c.lora_lr, c.lora_lr * o.min_lr / o.lr
    if role == "bank":
        c = recipe.memory.crossattn
        lr = c.bank_lr if c is not None and c.bank_lr is not None else o.lr
        return lr, lr * o.min_lr / o.lr
    return o.lr, o.min_lr


def bank_frozen_from(recipe: Recipe) -> Optional[int]:
    """The optimizer step (0-based) from which ``memory.crossattn.freeze_bank_at`` freezes the cross-attention
    bank and its W_K, W_V (Section 5.5's staged freezing); None without one (``freeze_bank`` freezes them at
    build time instead)."""
    c = recipe.memory.crossattn
    if not recipe.memory.is_crossattn or c is None or c.freeze_bank or not c.freeze_bank_at.value:
        return None
    return recipe.steps(c.freeze_bank_at)


def lr_at(recipe: Recipe, role: str = "anchor") -> Callable[[int], float]:
    """``step -> learning rate`` for optimizer step ``step`` (0-based). Every role follows the same
    warmup and cosine (train.schedule) between its own peak and floor (:func:`peak_lr`): the memory
    role from memory.optimizer.lr to memory.optimizer.min_lr (Appendix A.2); with memory_llama the
    memory and lora roles from their own peak to min_lr_ratio times it."""
    lr, floor = peak_lr(recipe, role)
    warmup, total = recipe.steps(recipe.train.schedule.warmup), recipe.max_steps
    kind = recipe.train.schedule.kind
    c = recipe.memory.crossattn
    # Section 5.5's staged freezing: from this step on the bank (and its W_K, W_V) stops moving; AdamW with a
    # learning rate of 0 applies neither the update nor the (decoupled) weight decay.
    frozen_from = (bank_frozen_from(recipe) or 0) if role == "bank" else 0
    frozen = role == "bank" and c is not None and c.freeze_bank  # from the start: 0 throughout (as logged)

    def schedule(step: int) -> float:
        if frozen or (frozen_from and step >= frozen_from):
            return 0.0
        if step < warmup:
            return lr * (step + 1) / warmup
        if kind == "constant":
            return lr
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return schedule


def build_scheduler(optimizer: torch.optim.Optimizer, recipe: Recipe) -> torch.optim.lr_scheduler.LambdaLR:
    lambdas = []
    for group in optimizer.param_groups:
        role = group.get("role", "anchor")
        base = peak_lr(recipe, role)[0]
        schedule = lr_at(recipe, role)
        lambdas.append(lambda step, schedule=schedule, base=base: schedule(step) / base)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)


# DeepSpeed's op builder name of its shared-memory all-reduce (deepspeed/ops/op_builder/cpu/comm.py).
SHM_COMM_OP = "deepspeed_shm_comm"


def skip_inference_shm_op() -> None:
    """Keep DeepSpeed from JIT-compiling its shared-memory all-reduce when its communication backend starts.

    On the CPU accelerator ``deepspeed.comm.torch.TorchBackend`` builds ``deepspeed_shm_comm`` (two C++
    files against torch's headers: 26 s, 46 CPU-seconds on 2 cores) into ``TORCH_EXTENSIONS_DIR`` at start-up,
    for ``inference_all_reduce`` only: DeepSpeed's inference engine, which memtrain never runs (training
    reduces through ``torch.distributed``). The Slurm template gives each job its own extensions folder,
    so every CPU job and every requeue paid that build again. Marking the op incompatible takes DeepSpeed's
    own "op not available" path (``build_shm_op`` returns None). No-op where DeepSpeed lacks the table."""
    import deepspeed.ops

    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if isinstance(compatible, dict):
        compatible[SHM_COMM_OP] = False


def initialize(model: nn.Module, recipe: Recipe, world_size: int, precision_name: str,
               load_universal: bool = False, align: bool = True):
    """``deepspeed.initialize`` with memtrain's optimizer, schedule and generated config. ``align``: cut the
    parameter groups for aligned flat buffers (:func:`split_for_alignment`) where DeepSpeed flattens; False
    keeps the groups uncut (the layout of checkpoints written before memtrain aligned them)."""
    import deepspeed

    skip_inference_shm_op()
    optimizer = build_optimizer(model, recipe, align=align and flattens(recipe, precision_name))
    scheduler = build_scheduler(optimizer, recipe)
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, lr_scheduler=scheduler,
        config=deepspeed_config(recipe, world_size, precision_name, load_universal), dist_init_required=False)
    return engine, optimizer, scheduler


def global_grad_norm(engine) -> float:
    """The gradient norm before clipping of the step just taken, over all ranks."""
    norm = engine.get_global_grad_norm()
    if norm is None:
        return float("nan")
    return float(norm)


def base_optimizer(engine):
    """The torch optimizer inside DeepSpeed's ZeRO or bf16 wrapper (or the engine's optimizer itself)."""
    return getattr(engine.optimizer, "optimizer", engine.optimizer)


@contextlib.contextmanager
def skipped_step(engine) -> Iterator[None]:
    """Make the ``engine.step()`` inside this block skip the optimizer update, through the path each DeepSpeed
    optimizer takes for an invalid gradient norm: it clears the gradients, leaves weights, moments and the
    learning-rate schedule untouched and reports ``engine.was_step_applied()`` False. The norm each one
    checks reads NaN here: ZeRO 1-2 ``scaled_global_norm`` (an invalid norm is an overflow in fp32 and bf16;
    their ``has_overflow``, replaced until 2026-11-30, runs only with fp16 or bf16, so fp32 applied the
    step), ZeRO 3 ``_get_norm_groups`` (its overflow check runs only with fp16: it applied the step in fp32
    and bf16), the bf16 optimizer of ZeRO 1 ``get_grads_for_norm``, and the bf16 optimizer without ZeRO its
    overflow checker. Without ZeRO in fp32 the engine steps the plain torch optimizer, which skips every
    parameter without a gradient: the gradients are dropped here (weights and moments untouched; DeepSpeed
    still steps the schedule). Used by the divergence guard, with the decision already agreed by every rank,
    so every rank skips the norm's collectives alike."""
    opt = engine.optimizer
    device = next(p.device for p in engine.module.parameters())
    nan = lambda: torch.full((), float("nan"), device=device)  # noqa: E731
    if hasattr(opt, "scaled_global_norm"):  # ZeRO 1-2
        target, name, stand_in = opt, "scaled_global_norm", lambda *args, **kwargs: nan()
    elif hasattr(opt, "_get_norm_groups"):  # ZeRO 3
        target, name, stand_in = opt, "_get_norm_groups", lambda *args, **kwargs: [nan()]
    elif hasattr(opt, "get_grads_for_norm") and hasattr(opt, "clear_hp_grads"):  # BF16_Optimizer (ZeRO 1, bf16)
        target, name = opt, "get_grads_for_norm"
        stand_in = lambda *args, **kwargs: ([nan()[None]], [])  # noqa: E731
    elif hasattr(getattr(opt, "overflow_checker", None), "check"):  # FP16_UnfusedOptimizer (no ZeRO, bf16)
        target, name, stand_in = opt.overflow_checker, "check", lambda *args, **kwargs: True
    else:
        for p in engine.module.parameters():
            p.grad = None
        # DeepSpeed's fp32 clipping indexes the first parameter with a gradient: nothing to clip here.
        target, name, stand_in = engine, "clip_fp32_gradients", lambda *args, **kwargs: None
    previous = target.__dict__.get(name)  # an instance's own wrapper (JointNorm's) comes back after the step
    setattr(target, name, stand_in)
    try:
        yield
    finally:
        if previous is not None:
            setattr(target, name, previous)
        else:
            delattr(target, name)  # the class's own method again


def weights_finite(engine) -> bool:
    """Whether every weight this rank's optimizer updates is finite (its fp32 master partitions under
    ZeRO 1-3 and bf16, the parameters themselves otherwise); local, no communication. ZeRO 3 empties its
    torch optimizer's groups between steps, so its flat fp32 partitions are read instead (until 2026-11-30
    this checked nothing there)."""
    flats = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None)  # ZeRO 3
    tensors = list(flats) if flats else [p for g in base_optimizer(engine).param_groups for p in g["params"]]
    return all(not p.numel() or bool(torch.isfinite(p.detach()).all()) for p in tensors)
