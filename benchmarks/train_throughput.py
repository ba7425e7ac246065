"""Training throughput of a recipe: a few optimizer steps as ``memtrain train`` takes them, timed.

What. Builds the model of ``RECIPE [key=value ...]`` exactly as the trainer does (``memtrain.model.build``,
the recipe's precision, the DeepSpeed engine of ``memtrain.parallel.engine.initialize``, the memory bank
for hierarchical memories with its fetch / reduce / clip / step, the sharded chapter bank of cross-attention
memories), runs ``--warmup`` untimed and ``--steps`` timed optimizer steps of ``accumulation`` micro-batches
each, and prints one JSON line: tokens/s, MFU, peak memory, the median forward / backward / optimizer
split of a step (the trainer's ``time/*_s``) and the host's part of each (``host_forward_s``, ``host_backward_s``,
``host_optimizer_s``: the time until the part's Python code returned, before the device was waited for; near the
part's own time on a GPU means host-bound, see ``StepClock``), the wall time of the first warm-up step
(``torch.compile`` of flex attention and of the blocks, Triton autotuning, DeepSpeed's lazy set-up) and the
environment. The
model gets the trainer's training options (``memtrain.launcher.train.configure_model``): the output says
which ran -- ``compiled_blocks`` (``model.compile``: auto compiles the decoder blocks on CUDA) with
``compile_s`` (seconds spent in torch.compile over the warm-up and timed steps), ``checkpoint_every``
(``parallel.activation_checkpointing``: 0 none, 1 every block, n every n-th) and ``loss_chunk_tokens``
(``train.loss_chunk_tokens``: the fused loss's chunk, 0 for full logits). All model types work:
``decoder`` (anchor alone, hierarchical memories, cross-attention memory), ``titans`` and ``hf``
(pretrained folder in ``model.pretrained``; memory_llama, cross-attention adapters, post-hoc memories).

How. One process, a world of one (memtrain's own ``dist.init``, gloo on CPU / NCCL on a GPU, as a single
``memtrain train`` does). Tokens are synthetic by default: uniform ids in ``[0, vocab)`` of shape
``[micro_batch_size, seq_len + 1]`` split into ``--docs`` equal documents (document ids are always passed,
so the document-masked attention path runs as in training), cluster ids uniform over the memory tree and
the generic-memory draw of the trainer (``generic_mask``); no prepared data is needed. ``--data`` reads
the recipe's prepared train split through memtrain's loader instead (``memtrain prepare`` first). The loss
is the trainer's token-weighted ``token_loss_sum`` scaled to the global token mean; ``loss_first``,
``loss_last``, ``loss_max`` and ``loss_all_finite`` (with ``nonfinite_loss_steps``, the first ten) cover
every step, warm-up included, so a run of 50+ steps doubles as a stability check. The banks are the
trainer's (``memtrain.launcher.train.build_banks``) and so are the FLOPs per token
(``memtrain.launcher.train.training_flops_per_token``: the anchor's formula, Titans' own count or ``6 N``
for ``hf``, plus the fetched memory and the cross-attention memory layers); MFU = FLOPs/token x tokens/s / peak, the peak
being ``logging.peak_flops`` or ``memtrain.model.flops.peak_flops(device)`` (null when unknown, e.g. on
CPU). Peak memory is ``torch.cuda.max_memory_allocated`` over the timed steps on a GPU, the process's
peak RSS (``resource.getrusage``, since start, imports included) on CPU; ``peak_memory_kind`` says which.
All timings are medians over the timed steps; on a GPU the device is synchronised around every phase
(as the trainer does on logged steps), which costs a little overlap. ``peak_memory_estimate_gib`` is
``memtrain recipe show``'s estimate for the same run (one rank), to compare with the measured peak on a GPU. ``--micro-batches N`` caps the
accumulation for speed: the DeepSpeed config is then generated for a global batch of N micro-batches
(``accumulation`` vs ``recipe_accumulation`` in the output); tokens/s is per step's actual tokens. The
GPU recipes accumulate 16-64 micro-batches per step: on a time-limited GPU ``--micro-batches 2``-``4``
keeps a run to a minute or two (accumulation changes only the optimizer's share of a step).
``--max-seconds S`` stops starting steps S seconds after start (after one timed step at least) and still
prints the JSON (``steps_done``: the timed steps that ran); each step prints a progress line on stderr.
``--profile K`` profiles one more step with ``torch.profiler``: ``profile_busy_fraction`` (the device's kernel
and copy time over that step's wall time), ``busy_of_timed_step`` (the same kernel time over the timed steps'
median: near 1 device-bound, well below 1 host-bound) and the top K kernels (``profile_top``, with launch counts).
The profiler adds host time to every op it records, not to the kernels, so a model that issues many small ops (eager
MAC) has a profiled step much longer than its timed ones, and ``profile_busy_fraction`` understates how busy its
device is; ``busy_of_timed_step`` does not.

``--compare-hf`` then times the same shape as ``transformers.LlamaForCausalLM`` (d_model, layers, heads,
kv heads, head_dim, ffn, vocab, tied embeddings, rope_theta; plain causal SDPA, no document mask) in the
same process after the memtrain engine is freed: ``torch.compile``-d (``--no-compile-hf`` skips it),
AdamW (fused on CUDA) with the recipe's betas / eps / weight decay, gradient clipping at
``train.grad_clip``, bf16 autocast over fp32 weights on CUDA (fp32 on CPU), the same micro-batch,
accumulation, warm-up and steps, and the same loss code (memtrain's ``token_loss_sum`` on the logits).
It prints a second line with HF's tokens/s and ``ratio_memtrain_over_hf``. Only for decoder anchors
without memory (anything else prints a ``skipped`` line).

Caveats. Synthetic tokens give a loss near ln(vocab) and uniform routing of cross-attention chapters /
uniform cluster ids (real data is skewed: fewer unique rows per fetch, a cheaper bank); ``--data`` for
the real mix. The HF baseline is a Llama: RMSNorm and no QK-norm, whereas memtrain's OpenLM-style
anchors use gain-only LayerNorm and QK-norm (``hf_shape_differences`` lists what differs), and it attends
causally over the whole sequence (memtrain passes document ids; with ``--docs 1`` the mask is the same
causal one). ``model.init_from`` is not loaded (weights do not change the cost); a sharded hierarchical
bank runs with world 1 (no exchange). Nothing is written: no run directory, no checkpoints, no metrics
(``torch.compile`` / Triton keep their usual caches). Not part of the test suite.

    python benchmarks/train_throughput.py recipes/quickstart.yaml --steps 3
    python benchmarks/train_throughput.py recipes/quickstart-memory.yaml --steps 2 --warmup 1 --micro-batches 1
    python benchmarks/train_throughput.py recipes/openlm-160m.yaml --compare-hf          # on a GPU
    python benchmarks/train_throughput.py recipes/openlm-410m.yaml parallel.activation_checkpointing=2 \
        train.micro_batch_size=2 --micro-batches 2                                      # on a GPU
    python benchmarks/train_throughput.py recipes/openlm-160m.yaml model.compile=false train.loss_chunk_tokens=0
    python benchmarks/train_throughput.py recipes/titans-170m-mac.yaml --micro-batches 4  # on a GPU
    python benchmarks/train_throughput.py recipes/openlm-160m.yaml train.micro_batch_size=8 --out tp.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib.metadata
import json
import math
import platform
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks' profiling helper

from memtrain.config import Recipe, load_recipe  # noqa: E402
from memtrain.launcher.console import library_output, set_library_log_levels  # noqa: E402
from memtrain.launcher.train import (  # noqa: E402
    StepClock, build_banks, check_kernels, clip_memory, clip_memory_after_step, compile_seconds, configure_model,
    label_kwargs, output_loss_sum, scored_tokens, to_device, token_loss_sum, training_flops_per_token,
)
from memtrain.parallel import dist  # noqa: E402
from profiling import profile_call  # noqa: E402


def _version(package: str) -> Optional[str]:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _round(x, digits: int = 4):
    if isinstance(x, float):
        return None if not math.isfinite(x) else float(f"{x:.{digits}g}") if abs(x) < 1e4 else round(x, 1)
    return x


def _median(values: list[float]) -> Optional[float]:
    return statistics.median(values) if values else None


# -- data ------------------------------------------------------------------------------------------


def synthetic_batches(recipe: Recipe, vocab: int, docs: int, layout, seed: int) -> Iterator[dict]:
    """Endless micro-batches shaped like :class:`memtrain.data.loader.Collate`'s: ``input_ids``/``labels``
    from uniform tokens ``[B, seq_len + 1]``, ``doc_ids`` of ``docs`` equal documents, ``sample_index``,
    and with a memory ``layout`` ``cluster_ids`` from a uniform leaf (``levels_from_leaf``)."""
    from memtrain.data.loader import levels_from_leaf

    B, T = recipe.train.micro_batch_size, recipe.data.seq_len
    g = torch.Generator().manual_seed(seed)
    doc_ids = (torch.arange(T) * max(1, docs) // T).expand(B, T).contiguous()
    n = 0
    while True:
        tokens = torch.randint(0, vocab, (B, T + 1), generator=g)
        batch = {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                 "doc_ids": doc_ids.clone(), "sample_index": torch.arange(n, n + B)}
        if layout is not None:
            leaf = torch.randint(0, layout.branching ** layout.depth, (B,), generator=g)
            batch["cluster_ids"] = levels_from_leaf(leaf, layout.branching, layout.depth)
        n += B
        yield batch


def prepared_batches(recipe: Recipe) -> Iterator[dict]:
    """The recipe's prepared train split through memtrain's loader (as the trainer reads it)."""
    from memtrain.data.loader import LoaderIterator, build_loader, recipe_meta
    from memtrain.data.verify import check_recipe_data

    check_recipe_data(recipe, recipe_meta(recipe))
    return LoaderIterator(build_loader(recipe, "train", recipe.train.micro_batch_size))


# -- memtrain --------------------------------------------------------------------------------------


class MemtrainStep:
    """The trainer's model, engine and banks, and one optimizer step as ``memtrain train`` takes it
    (memtrain.launcher.train._train's loop without logging, evaluation, checkpoints or the divergence
    guard's skip)."""

    def __init__(self, recipe: Recipe, device: torch.device, prec: str, accum: int):
        from memtrain.model import build, count_parameters, peak_flops
        from memtrain.parallel.engine import initialize

        verbose = recipe.logging.verbose
        with library_output(verbose):
            import deepspeed  # noqa: F401
        set_library_log_levels(verbose)
        self.recipe, self.device, self.accum = recipe, device, accum
        mem = recipe.memory
        torch.manual_seed(recipe.run.seed)
        model = build(recipe.model, mem, recipe.data.clustering.branching)
        if mem.freeze_anchor:
            for p in model.anchor_parameters():
                p.requires_grad_(False)
        # The trainer's options: checkpointing, fused loss, compiled blocks (model.compile)
        self.options = configure_model(model, recipe, device)
        self.compile_base = compile_seconds() if self.options["compiled_blocks"] else None
        self.params = count_parameters(model)
        banks = build_banks(model, recipe, device, prec, 1)  # the trainer's banks, before .to(device)
        model.to(device)
        self.bank, self.joint, self.memory_schedule = banks.bank, banks.joint, banks.memory_schedule
        if self.bank is not None:
            from memtrain.model.hierarchical import generic_mask

            self.generic_mask = generic_mask
        self.step_bank = banks.stepped
        self.bank_params = None
        if self.step_bank is not None:  # outside the model (not in `params`)
            self.bank_params = self.step_bank.numel() if hasattr(self.step_bank, "numel") else None
        with library_output(verbose):
            self.engine, _, _ = initialize(model, recipe, 1, prec)
        self.joint_norm = None
        if self.step_bank is not None and self.joint and recipe.parallel.zero_stage > 0:
            from memtrain.parallel.engine import JointNorm

            self.joint_norm = JointNorm(self.engine, recipe.train.grad_clip)
        self.model = model
        self.layout = model.memory_layout if self.bank is not None else None
        self.vocab = getattr(model, "vocab_size", None) if recipe.model.type == "hf" else recipe.model.vocab_size
        self.fpt = training_flops_per_token(model, recipe)  # the trainer's FLOPs per token
        self.peak = recipe.logging.peak_flops or peak_flops(device)
        self.engine.train()

    def step(self, micro: list[dict], step: int, clock: StepClock) -> float:
        """One optimizer step over ``micro`` (on the device); returns the step's mean token loss."""
        engine, bank, recipe = self.engine, self.bank, self.recipe
        step_tokens = float(sum(scored_tokens(b["labels"]) for b in micro))
        scale = self.accum / max(step_tokens, 1.0)
        ce_parts = []
        for batch in micro:
            clock.start()
            memory = None
            if bank is not None:
                generic = self.generic_mask(batch["sample_index"], step, recipe.run.seed, recipe.generic_prob)
                memory = bank.fetch(batch["cluster_ids"], generic.to(self.device))
            out = engine(batch["input_ids"], doc_ids=batch["doc_ids"], memory=memory, **label_kwargs(self.model, batch))
            ce = output_loss_sum(out, batch["labels"])
            loss = ce * scale
            ce_parts.append(ce.detach())
            if out.aux_loss is not None:
                loss = loss + out.aux_loss
            clock.mark("forward")
            engine.backward(loss)
            clock.mark("backward")
            boundary = engine.is_gradient_accumulation_boundary()
            norms = None
            if boundary:
                if self.step_bank is not None:
                    self.step_bank.reduce_gradients()
                    norms = clip_memory(engine, self.step_bank, recipe, self.joint, self.joint_norm)
                elif recipe.parallel.zero_stage == 0:  # the trainer's pre-clip norm (a sync)
                    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
                    if grads:
                        float(torch.nn.utils.get_total_norm(grads))
            engine.step()
            if boundary and self.joint_norm is not None:
                clip_memory_after_step(self.step_bank, self.joint_norm, norms)
            clock.mark("optimizer")
        clock.start()
        if self.step_bank is not None:
            self.step_bank.step(self.memory_schedule(step))
        clock.mark("optimizer")
        return float(torch.stack(ce_parts).sum()) / max(step_tokens, 1.0)


# -- Hugging Face baseline -------------------------------------------------------------------------


def hf_differences(cfg) -> list[str]:
    diffs = []
    if cfg.norm != "rmsnorm":
        diffs.append(f"norm {cfg.norm} (HF Llama: RMSNorm)")
    if cfg.qk_norm:
        diffs.append("qk_norm (HF Llama: none)")
    if cfg.reset_positions:
        diffs.append("RoPE positions reset per document (the same with --docs 1)")
    return diffs


class HFStep:
    """``transformers.LlamaForCausalLM`` of the recipe's shape with AdamW, optionally ``torch.compile``-d."""

    def __init__(self, recipe: Recipe, device: torch.device, accum: int, compile_model: bool):
        from transformers import LlamaConfig, LlamaForCausalLM

        m, o = recipe.model, recipe.train.optimizer
        head_dim = m.head_dim or m.d_model // m.n_heads
        cfg = LlamaConfig(vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.ffn_dim,
                          num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads,
                          num_key_value_heads=m.n_kv_heads or m.n_heads, head_dim=head_dim,
                          max_position_embeddings=max(m.max_seq_len, recipe.data.seq_len), rms_norm_eps=m.norm_eps,
                          rope_theta=m.rope_theta, tie_word_embeddings=m.tie_embeddings, attention_bias=False,
                          mlp_bias=False, use_cache=False, initializer_range=m.init_std or m.d_model ** -0.5,
                          attn_implementation="sdpa")
        torch.manual_seed(recipe.run.seed)
        model = LlamaForCausalLM(cfg).to(device)
        model.train()
        self.params = sum(p.numel() for p in model.parameters())
        self.model = model
        self.forward = torch.compile(model) if compile_model else model
        fused = device.type == "cuda"
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                           weight_decay=o.weight_decay, fused=fused)
        self.clip = recipe.train.grad_clip
        self.device, self.accum = device, accum
        self.autocast = device.type == "cuda"
        self.precision = "bf16 autocast, fp32 weights" if self.autocast else "fp32"
        self.optimizer_name = "AdamW (fused)" if fused else "AdamW"

    def step(self, micro: list[dict], step: int, clock: StepClock) -> float:
        step_tokens = float(sum(scored_tokens(b["labels"]) for b in micro))
        scale = 1.0 / max(step_tokens, 1.0)
        ce_parts = []
        for batch in micro:
            clock.start()
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast):
                logits = self.forward(input_ids=batch["input_ids"], use_cache=False).logits
            ce = token_loss_sum(logits, batch["labels"])
            ce_parts.append(ce.detach())
            clock.mark("forward")
            (ce * scale).backward()
            clock.mark("backward")
        clock.start()
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        clock.mark("optimizer")
        return float(torch.stack(ce_parts).sum()) / max(step_tokens, 1.0)


# -- timing ----------------------------------------------------------------------------------------


def peak_memory(device: torch.device) -> tuple[float, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30, "cuda_max_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "cpu_max_rss_since_start"  # KiB on Linux


def time_steps(runner, batches: Iterator[dict], device: torch.device, accum: int, warmup: int, steps: int,
               tokens_per_step: int, deadline: Optional[float] = None, label: str = "memtrain") -> dict:
    """``warmup`` untimed then ``steps`` timed optimizer steps of ``runner``; medians of the split.

    ``deadline`` (``time.monotonic()``): no step starts after it once one timed step is done, so a time-capped
    run still reports (``steps_done`` says how many were timed). Each step prints one progress line on stderr."""
    first = None
    rows = []
    losses = []
    for i in range(warmup + steps):
        if deadline is not None and rows and time.monotonic() >= deadline:
            break
        if i == warmup and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        t0 = time.perf_counter()
        micro = [to_device(next(batches), device) for _ in range(accum)]
        data_s = time.perf_counter() - t0
        clock = StepClock(device, sync=True)
        losses.append(runner.step(micro, i, clock))  # float(loss): waits for the device
        _sync(device)
        step_s = time.perf_counter() - t0
        if i == 0:
            first = step_s
        if i >= warmup:
            rows.append({"step_s": step_s, "data_s": data_s, **{f"{k}_s": v for k, v in clock.seconds.items()},
                         **{f"host_{k}_s": v for k, v in clock.host.items()}})
        print(f"{label} step {i + 1}/{warmup + steps}{' (warm-up)' if i < warmup else ''}: {step_s:.3f} s, "
              f"loss {losses[-1]:.4f}", file=sys.stderr, flush=True)
    step_s = _median([r["step_s"] for r in rows])
    out = {"first_step_s": first if warmup else None, "step_s": step_s,
           "tokens_per_s": tokens_per_step / step_s if step_s else None}
    for key in ("forward_s", "backward_s", "optimizer_s", "data_s", "host_forward_s", "host_backward_s",
                "host_optimizer_s"):
        out[key] = _median([r[key] for r in rows])
    out["other_s"] = _median([r["step_s"] - r["data_s"] - r["forward_s"] - r["backward_s"] - r["optimizer_s"]
                              for r in rows])
    out["step_s_all"] = [r["step_s"] for r in rows]
    out["steps_done"] = len(rows)
    out["loss_first"], out["loss_last"] = losses[0], losses[-1]
    bad = [i for i, x in enumerate(losses) if not math.isfinite(x)]  # over warm-up and timed steps
    out["loss_all_finite"], out["nonfinite_loss_steps"] = not bad, bad[:10]
    out["loss_max"] = max((x for x in losses if math.isfinite(x)), default=None)
    mem, kind = peak_memory(device)
    out["peak_memory_gib"], out["peak_memory_kind"] = mem, kind
    return out


def profile_step(runner, batches: Iterator[dict], device: torch.device, accum: int, step: int, top: int) -> dict:
    """One more optimizer step under ``torch.profiler`` (:func:`profiling.profile_call`): where its time goes.
    ``profile_step_s`` is its wall time, ``profile_device_busy_s`` the summed time of the device's kernels and
    copies (on CPU: every op's self time), so busy / step near 1 means device-bound and well below 1 host-bound
    (launch overhead, Python); the ``top`` ops by self device time, with their launch counts. The profiler adds
    host overhead to the step."""
    micro = [to_device(next(batches), device) for _ in range(accum)]
    prof = profile_call(lambda: runner.step(micro, step, StepClock(device, sync=True)), device, top)
    return {f"profile_{k}": v for k, v in prof.items()}


def busy_of_timed_step(res: dict) -> Optional[float]:
    """The profiled step's device time (its kernels and copies, which the profiler does not stretch) over the timed
    steps' median wall time: the device's share of an unprofiled step. The profiled step's own
    ``profile_busy_fraction`` divides by a wall time the profiler lengthened by its cost per op (on an H200, eager
    titans-170m-mac: 37% busy in a 1.4 s profiled step, 0.52 s of kernels per 0.83 s timed step, so 63%)."""
    busy, step = res.get("profile_device_busy_s"), res.get("step_s")
    return busy / step if busy is not None and step else None


def _rounded(rec: dict) -> dict:
    return {k: ([_round(x) for x in v] if isinstance(v, list) and v and isinstance(v[0], float) else _round(v))
            for k, v in rec.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe", help="recipe YAML")
    ap.add_argument("overrides", nargs="*", help="key=value overrides, as for `memtrain train`")
    ap.add_argument("--steps", type=int, default=5, help="timed optimizer steps (median)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps first (the first compiles)")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--synthetic", dest="data", action="store_false", help="uniform random tokens (default)")
    src.add_argument("--data", dest="data", action="store_true", help="the recipe's prepared train split")
    ap.set_defaults(data=False)
    ap.add_argument("--docs", type=int, default=1, help="documents per synthetic sequence (equal lengths)")
    ap.add_argument("--micro-batches", type=int, default=None,
                    help="cap the micro-batches per optimizer step (default: the recipe's accumulation)")
    ap.add_argument("--compare-hf", action="store_true",
                    help="also time a transformers LlamaForCausalLM of the same shape and print the ratio")
    ap.add_argument("--no-compile-hf", action="store_true", help="with --compare-hf: no torch.compile")
    ap.add_argument("--seed", type=int, default=0, help="seed of the synthetic tokens")
    ap.add_argument("--out", default=None, help="also write the JSON lines to this file")
    ap.add_argument("--profile", type=int, default=0, metavar="K",
                    help="after the timed steps, profile one more step: its device-busy fraction and top K ops")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="wall-time cap from start: no further step starts after it once one timed step is done "
                         "(the JSON's steps_done says how many ran; with --compare-hf each model gets half)")
    args = ap.parse_intermixed_args()
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    if args.max_seconds is not None and args.max_seconds <= 0:
        ap.error("--max-seconds must be > 0")
    if args.profile < 0:
        ap.error("--profile must be >= 0")
    args.started = time.monotonic()

    out = open(args.out, "w") if args.out else None
    stdout = sys.stdout  # the JSON lines only: anything else printed (DeepSpeed's op builds) goes to stderr

    def emit(rec: dict) -> None:
        line = json.dumps(_rounded(rec))
        print(line, file=stdout, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    try:
        with contextlib.redirect_stdout(sys.stderr):
            return _run(args, emit)
    finally:
        if out:
            out.close()
        dist.shutdown()


def _run(args, emit) -> int:
    recipe = load_recipe(args.recipe, args.overrides)
    dist_env = dist.discover()
    if dist_env.world_size != 1:
        raise SystemExit("train_throughput.py runs as a single process; start it without a launcher")
    device = dist.resolve_device(recipe.run.device, dist_env)
    from memtrain.parallel.engine import precision

    prec = precision(recipe, device)
    recipe_accum = recipe.grad_accum_steps(1)
    accum = min(recipe_accum, args.micro_batches) if args.micro_batches else recipe_accum
    if accum != recipe_accum:  # DeepSpeed's config (and the loss scale) for a global batch of `accum`
        recipe.train = dataclasses.replace(
            recipe.train, global_batch_tokens=accum * recipe.train.micro_batch_size * recipe.data.seq_len)
    check_kernels(recipe, device)
    dist.init(dist_env, device, recipe.parallel.backend, timeout_minutes=recipe.parallel.timeout_minutes)

    tokens_per_step = accum * recipe.train.micro_batch_size * recipe.data.seq_len
    env = {"recipe": args.recipe, "run_name": recipe.run.name, "overrides": args.overrides,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda"
           else f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)",
           "torch": torch.__version__, "deepspeed": _version("deepspeed"), "triton": _version("triton"),
           "micro_batch_size": recipe.train.micro_batch_size, "seq_len": recipe.data.seq_len,
           "accumulation": accum, "recipe_accumulation": recipe_accum, "tokens_per_step": tokens_per_step,
           "data": "prepared" if args.data else "synthetic",
           "docs_per_sequence": None if args.data else args.docs, "warmup": args.warmup, "steps": args.steps}

    t0 = time.perf_counter()
    runner = MemtrainStep(recipe, device, prec, accum)
    build_s = time.perf_counter() - t0
    batches = prepared_batches(recipe) if args.data else synthetic_batches(
        recipe, runner.vocab, args.docs, runner.layout, args.seed)
    deadline = None
    if args.max_seconds is not None:
        deadline = args.started + (args.max_seconds / 2 if args.compare_hf else args.max_seconds)
    res = time_steps(runner, batches, device, accum, args.warmup, args.steps, tokens_per_step, deadline)
    mfu = runner.fpt * res["tokens_per_s"] / runner.peak if runner.peak and res["tokens_per_s"] else None
    if args.profile:
        res.update(profile_step(runner, batches, device, accum, args.warmup + args.steps, args.profile))
        res["busy_of_timed_step"] = busy_of_timed_step(res)
    from memtrain.parallel.memory_estimate import estimate_peak_memory

    estimate = estimate_peak_memory(recipe, 1, prec, runner.model).total / 2**30  # `memtrain recipe show`'s
    c = recipe.memory.crossattn
    rec = {"kind": "memtrain", **env, "model_type": recipe.model.type, "memory_type": recipe.memory.type,
           "bank": (recipe.memory.bank if recipe.memory.enabled else
                    getattr(c, "bank", None) if recipe.memory.is_crossattn and c is not None else None),
           "precision": prec, "zero_stage": recipe.parallel.zero_stage,
           "activation_checkpointing": recipe.parallel.activation_checkpointing,
           "checkpoint_every": runner.options["checkpoint_every"], "loss_chunk_tokens": runner.options["loss_chunk_tokens"],
           "compiled_blocks": runner.options["compiled_blocks"], "compile_mode": runner.options["compile_mode"],
           "compile_s": (compile_seconds() - runner.compile_base) if runner.compile_base is not None else None,
           "attention": recipe.model.attention, "params": runner.params,
           "bank_params": runner.bank_params,
           "flops_per_token": runner.fpt, "peak_flops": runner.peak, "mfu": mfu, "build_s": build_s, **res,
           "peak_memory_estimate_gib": estimate}
    emit(rec)

    if args.compare_hf:
        anchor_only = recipe.model.type == "decoder" and recipe.memory.type == "none"
        if not anchor_only:
            emit({"kind": "hf", "skipped": f"--compare-hf needs a decoder anchor without memory; this recipe is "
                  f"model.type {recipe.model.type} with memory.type {recipe.memory.type}", **env})
            return 0
        batches = None
        if hasattr(runner.engine, "destroy"):
            runner.engine.destroy()
        del runner
        gc.collect()
        leftover = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
            leftover = torch.cuda.memory_allocated(device) / 2**30  # part of HF's peak below
        from memtrain.model import flops_per_token

        t0 = time.perf_counter()
        hf = HFStep(recipe, device, accum, compile_model=not args.no_compile_hf)
        hf_build_s = time.perf_counter() - t0
        batches = prepared_batches(recipe) if args.data else synthetic_batches(
            recipe, recipe.model.vocab_size, args.docs, None, args.seed)
        hres = time_steps(hf, batches, device, accum, args.warmup, args.steps, tokens_per_step,
                          None if args.max_seconds is None else args.started + args.max_seconds, label="hf")
        fpt = flops_per_token(recipe.model, recipe.data.seq_len)
        peak = rec["peak_flops"]
        emit({"kind": "hf", **env, "model": "transformers.LlamaForCausalLM", "transformers": _version("transformers"),
              "attention": "sdpa (causal, no document mask)", "compiled": not args.no_compile_hf,
              "precision": hf.precision, "optimizer": hf.optimizer_name, "grad_clip": hf.clip,
              "params": hf.params, "hf_shape_differences": hf_differences(recipe.model),
              "flops_per_token": fpt, "peak_flops": peak,
              "mfu": fpt * hres["tokens_per_s"] / peak if peak and hres["tokens_per_s"] else None,
              "build_s": hf_build_s, **hres, "memtrain_leftover_allocated_gib": leftover,
              "memtrain_tokens_per_s": rec["tokens_per_s"],
              "ratio_memtrain_over_hf": rec["tokens_per_s"] / hres["tokens_per_s"]})
    return 0


def _main() -> int:
    from memtrain.errors import MemtrainError

    try:
        return main()
    except MemtrainError as e:  # a recipe, data or launch problem: one line, as `memtrain train` reports it
        print(f"train_throughput.py: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(_main())
