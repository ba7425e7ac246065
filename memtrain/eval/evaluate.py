"""`memtrain eval RECIPE [key=value ...] [checkpoint=PATH]`: evaluate a trained checkpoint.

Everything runs in one process, without DeepSpeed or a process group: the model is built from the
recipe, the checkpoint's files are verified against the checksums in its ``COMPLETE.json``
(:func:`memtrain.parallel.checkpoint.verify`), its weights are loaded strictly
(:func:`memtrain.parallel.checkpoint.load_module_state`) together with the memory bank, and the model runs
in eval mode in fp32. While they are read the folder is held against pruning by a training run still
writing the run directory (:func:`memtrain.parallel.checkpoint.reading`). What runs:

- hierarchical memories (:mod:`memtrain.eval.hierarchical`): val perplexity per memory mode and, with
  ``builtin:longtail`` among the sources, the fact probes per mode (fetched, generic, blocked,
  corrupted retrieval);
- long-context tasks (:mod:`memtrain.eval.longctx`, tasks from :mod:`memtrain.data.tasks`): S-NIAH and
  BABILong-style qa1-qa5, by default for ``model.type: titans`` and ``memory.type: memory_llama``.

The report is written as JSON to ``<run dir of the checkpoint>/eval/<tag>.json`` (``--out`` elsewhere)
and printed as a table (:func:`format_table`).

Import cost: torch and numpy only; Streaming, sentence-transformers and the model code are imported
by the functions that use them.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from memtrain.config import Recipe, RecipeError, TitansConfig
from memtrain.errors import CheckpointError
from memtrain.eval.common import write_json_atomic
from memtrain.eval.hierarchical import BUCKETS, check_modes, mode_names, probe_accuracy, val_perplexity
from memtrain.eval.longctx import (
    TASK_BATCH_SIZE, PromptEncoder, check_long_context, long_context, long_context_lines, task_examples,
)


# --------------------------------------------------------------------------------------------------
# Loading


def pick_device(recipe: Recipe) -> torch.device:
    """cuda when one is visible and ``run.device`` allows it (auto, cuda), else cpu; ``run.device: cuda``
    without a GPU is a LaunchError."""
    from memtrain.parallel.dist import DistEnv, resolve_device

    return resolve_device(recipe.run.device, DistEnv(0, 0, 1, 1, "127.0.0.1", 0, "single"))


def find_checkpoint(recipe: Recipe, path: Optional[str | Path] = None) -> Any:
    """The checkpoint to evaluate: ``path`` (a run dir or a ``checkpoints/global_stepN`` folder) or the
    newest complete checkpoint in ``run.dir``; CheckpointError when there is none, or when a damaged one (a
    marker that cannot be parsed) is newer: it is named with its fallback rather than silently passed over."""
    from memtrain.parallel import checkpoint as ckpt

    if path is not None:
        return ckpt.resolve(path)
    info = ckpt.latest_checkpoint(recipe.run_dir)
    if info is None:
        raise CheckpointError(f"no complete checkpoint in run.dir {recipe.run_dir}; train first (`memtrain train "
                              "RECIPE`), set run.dir, or pass checkpoint=PATH")
    return info


def load_model(recipe: Recipe, info: Any, device: torch.device) -> tuple[torch.nn.Module, Any]:
    """Build the recipe's model, load the checkpoint's weights strictly (every key, every shape) and,
    with memories, build the bank and load its rows; returns (model in eval mode, bank or None).
    CheckpointError when the checkpoint does not fit the recipe."""
    from memtrain.model import build
    from memtrain.parallel import checkpoint as ckpt

    torch.manual_seed(recipe.run.seed)
    model = build(recipe.model, recipe.memory, recipe.data.clustering.branching)
    state = ckpt.load_module_state(info)
    c = recipe.memory.crossattn
    if recipe.memory.is_crossattn and c is not None and c.bank == "sharded":
        # The sharded chapter bank is in the checkpoint's DCP bank folder, not in DeepSpeed's module state.
        from memtrain.parallel.chapter_bank import latent_bank_state

        state = {**state, **latent_bank_state(info.path, width=c.dim or recipe.model.d_model)}
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # shape mismatches
        raise CheckpointError(f"the weights of {info.path} do not fit the recipe's model "
                              f"({str(e).splitlines()[-1].strip()[:200]}); use the recipe the run was trained "
                              "with") from None
    # A tied weight (the LM head sharing the embedding) may be saved under one of its names only.
    own = model.state_dict(keep_vars=True)
    loaded = {own[k].data_ptr() for k in state if k in own}
    missing = [k for k in result.missing_keys if own[k].data_ptr() not in loaded]
    if missing or result.unexpected_keys:
        what = f"missing {missing[:3]}" if missing else f"unexpected {list(result.unexpected_keys)[:3]}"
        raise CheckpointError(f"the weights of {info.path} do not fit the recipe's model ({what}); use the recipe "
                              "the run was trained with")
    model.to(device).eval()
    bank = None
    if recipe.memory.enabled:
        from memtrain.parallel.bank import MemoryBank

        bank = MemoryBank(model.memory_layout, device, seed=recipe.run.seed)
        ckpt.load_bank(bank, info.path)
        bank.requires_grad_(False)
    return model, bank


# --------------------------------------------------------------------------------------------------
# Entry point


def evaluate(recipe: Recipe, checkpoint: Optional[str | Path] = None, batches: Optional[int] = None,
             out: Optional[str | Path] = None, modes: Optional[Sequence[str]] = None,
             probe_batch_size: int = 64, tasks: Optional[str | Sequence[str]] = None,
             lengths: Optional[str | Sequence[int]] = None, samples: Optional[int] = None,
             max_new_tokens: Optional[int] = None, task_batch_size: int = TASK_BATCH_SIZE) -> dict[str, Any]:
    """Evaluate a checkpoint of ``recipe``'s run and write the JSON report; returns the report with
    ``"path"`` (where it was written).

    ``checkpoint``: a run dir or a ``global_stepN`` folder (default: the newest complete checkpoint in
    ``run.dir``). ``batches``: val micro-batches for perplexity, evenly spaced over the split as in
    training's validation (default ``train.eval.batches``, where 0 means the whole split; an explicit 0
    skips perplexity). ``out``: the JSON file (default ``<run dir>/eval/<tag>.json``, the run dir that holds
    the checkpoint). ``modes``: default :func:`mode_names`. ``tasks``, ``lengths``, ``samples``,
    ``max_new_tokens``: the long-context tasks (:func:`check_long_context`, :func:`run_long_context`).
    Every user error (data not prepared, no or incompatible checkpoint, memory modes without memories,
    unknown tasks) is raised before anything is written."""
    from memtrain.data.loader import data_location, read_meta
    from memtrain.model.switches import check_kernels
    from memtrain.parallel import checkpoint as ckpt

    start = time.perf_counter()
    data_dir, remote = data_location(recipe)
    meta = read_meta(data_dir, recipe)  # DataError when `memtrain prepare` has not run
    if meta["vocab_size"] > recipe.model.vocab_size and recipe.model.type != "hf":
        raise RecipeError("model.vocab_size", f"{recipe.model.vocab_size} is smaller than the tokenizer's "
                          f"{meta['vocab_size']} tokens in {recipe.data_dir}")
    depth = recipe.data.clustering.depth if recipe.memory.enabled else None  # hierarchical memories only
    modes = check_modes(modes if modes is not None else mode_names(depth), depth, recipe.memory.type)
    skip_perplexity = batches == 0
    if batches is None:
        batches = recipe.train.eval.batches  # 0 here: the whole val split
    if batches < 0:
        raise RecipeError("train.eval.batches", f"must be >= 0, got {batches}")
    task_names, task_lengths, task_samples, max_new = check_long_context(recipe, tasks, lengths, samples,
                                                                         max_new_tokens)
    info = find_checkpoint(recipe, checkpoint)
    ppl_modes = [m for m in modes if m in ("fetched", "generic", "none")]
    perplexity = not skip_perplexity and ppl_modes and meta.get("val_samples", 0) > 0
    if perplexity and not remote:  # the val shards, as training checks its data (Streaming checks downloads)
        from memtrain.data.verify import damaged, verify_folder

        problems = verify_folder(data_dir, splits=("val",)).problems
        if problems:
            raise damaged(data_dir, problems)
    examples, tokenizer, encoder = [], None, None
    if task_names:
        from memtrain.data.verify import prepared_tokenizer

        tokenizer = prepared_tokenizer(data_dir, meta, remote)
        encoder = PromptEncoder(tokenizer)
        examples = task_examples(task_names, task_lengths, task_samples, encoder)
    device = pick_device(recipe)
    check_kernels(recipe, device)  # kernel: triton where it cannot run is one line, not a traceback mid-forward
    # Held against pruning by a training run writing this run.dir while its files are read; every file
    # is checked against the checksums in COMPLETE.json before any is loaded.
    with ckpt.reading(info):
        state = ckpt.read_trainer_state(info)
        ckpt.check_compatible(info, state, recipe, info.world_size)
        ckpt.verify(info)
        model, bank = load_model(recipe, info, device)

    report: dict[str, Any] = {
        "recipe": recipe.run.name,
        "checkpoint": {"path": str(info.path), "tag": info.tag, "step": info.step,
                       "tokens_seen": state.get("tokens_seen")},
        "device": str(device),
        "data_dir": str(data_dir),
        "model": {"type": recipe.model.type,
                  "variant": ((recipe.model.titans or TitansConfig()).variant if recipe.model.type == "titans"
                              else None)},
        "memory": ({"type": recipe.memory.type, "levels": list(recipe.memory.levels),
                    "branching": recipe.data.clustering.branching, "depth": recipe.data.clustering.depth}
                   if bank is not None else {"type": recipe.memory.type} if recipe.memory.type != "none" else None),
        "modes": modes,
    }
    report["perplexity"] = {}
    if perplexity:
        report["perplexity"] = val_perplexity(model, bank, recipe, ppl_modes, batches, device)
    report["probes"] = None
    if "builtin:longtail" in recipe.data.sources:
        report["probes"] = probe_accuracy(model, bank, recipe, data_dir, meta, modes, device, probe_batch_size)
    report["long_context"] = None
    if task_names:
        report["long_context"] = long_context(model, bank, recipe, tokenizer, encoder, examples, task_names,
                                              task_lengths, task_samples, max_new, device, task_batch_size)
    report["seconds"] = round(time.perf_counter() - start, 3)

    path = Path(out) if out is not None else info.path.parent.parent / "eval" / f"{info.tag}.json"
    write_json_atomic(path, report)
    report["path"] = str(path)
    return report


def format_table(report: dict[str, Any]) -> str:
    """The readable summary: one row per mode with the val perplexity (where measured) and the probe
    accuracy (%) overall and per bucket."""
    ck = report["checkpoint"]
    mem = report.get("memory")
    head = f"checkpoint {ck['path']} (step {ck['step']}) on {report['device']}"
    model = report.get("model") or {}
    if model.get("type") in ("titans", "hf"):
        head += f" | {model['type']}" + (f" {model['variant'].upper()}" if model.get("variant") else "")
    if mem and "levels" in mem:
        head += f" | {mem['type']} memory levels {mem['levels']}, k={mem['branching']} p={mem['depth']}"
    elif mem:
        head += f" | {mem['type']} memory"
    lines = [head]
    ppl = report.get("perplexity") or {}
    probes = report.get("probes")
    width = max(len("mode"), *(len(m) for m in report["modes"]))
    cols = ["val ppl"] + (["all", *BUCKETS] if probes else [])
    lines.append(f"{'mode':<{width}}  " + "  ".join(f"{c:>8}" for c in cols))
    for mode in report["modes"]:
        cells = [f"{ppl[mode]['perplexity']:8.3f}" if mode in ppl else f"{'-':>8}"]
        if probes:
            acc = probes["modes"][mode]
            groups = [acc["all"]] + [acc["buckets"][b] for b in BUCKETS]
            cells += [f"{100 * g['accuracy']:7.1f}%" if g["accuracy"] is not None else f"{'-':>8}" for g in groups]
        lines.append(f"{mode:<{width}}  " + "  ".join(cells))
    if ppl:
        any_mode = next(iter(ppl.values()))
        lines.append(f"val: {any_mode['tokens']:,} tokens in {any_mode['batches']} micro-batches")
    if probes:
        b = probes["buckets"]
        lines.append(f"probes: {probes['count']} (head {b['head']}, torso {b['torso']}, tail {b['tail']}); "
                     "per-kind accuracy in the JSON")
    if report.get("long_context"):
        lines += long_context_lines(report["long_context"])
    if "path" in report:
        lines.append(f"wrote {report['path']}")
    return "\n".join(lines)


__all__ = ["evaluate", "find_checkpoint", "format_table", "load_model", "pick_device"]
