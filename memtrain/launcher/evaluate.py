"""Evaluation of a trained checkpoint: `memtrain eval RECIPE [key=value ...] [checkpoint=PATH]`.

Hierarchical-memories paper (Pouransari et al.):

- **Perplexity on the validation split** with *fetched* memories (each sequence's own cluster ids,
  assigned by ``memtrain prepare`` from the full document, as the paper does for Wiki-En: Appendix B)
  and with the *generic* memory (Section 4, Appendix E: one block per level, independent of the
  input); a memory-less model reports ``none`` (the anchor alone).
- **Fact probes** of the built-in long-tail corpus (:func:`memtrain.data.longtail.probes`, the
  cloze form of the Appendix B "Elements atomic number" task), when ``builtin:longtail`` is among
  ``data.sources``. Memories are retrieved *from the prompt* (Section 2.1, Appendix B: "we use the
  prompt, including the element name, for memory retrieval"): the prompt is embedded with the
  clustering embedding model and descends the prepared tree greedily. A probe is correct when the
  model's argmax prediction at every answer position equals the answer token (teacher-forced greedy
  exact match, equal to greedy generation producing the answer first). Modes:

  * ``fetched``: the retrieved ids; ``generic``: the generic memory; ``none``: the anchor alone
    (memory-less models only, unless asked for);
  * ``blocked`` (Section 4 "Blocking part of the memory bank", Fig. 6b): the best-matching level-1
    subtree (1/k of the bank) is blocked, i.e. level 1 takes the second-closest centroid and the
    descent continues greedily below it (:func:`blocked_ids`);
  * ``corrupt_from_level_c`` for c = p .. 1 (Section 4 "Failure analysis of retriever", Appendix J:
    the ids are corrupted from the finest level to the coarsest): levels < c keep their ids, every
    level >= c moves to another valid tree path (:func:`corrupt_ids`).

Long-context tasks (Titans Sections 5.3-5.4; the MemoryLlama thesis Section 4.2.3), generated offline
by :mod:`memtrain.model.titans.eval_tasks`: single needle in a haystack (``passkey``, ``number``,
``word``: RULER's S-NIAH) and BABILong-style fact chaining (``qa1``-``qa5``), ``samples`` examples per
task and prompt length, lengths in tokens of the run's tokenizer (:func:`task_examples`). Each prompt
is tokenized, the model generates greedily up to ``max_new_tokens`` tokens without a KV cache
(stopping at end-of-text; :func:`greedy_generate`), the text is decoded and scored by
:func:`~memtrain.model.titans.eval_tasks.score` (the answer as a whole word). They run by default for
``model.type: titans`` and ``memory.type: memory_llama``, for other models with ``tasks``. Every
sample starts from the model's initial memory:

* Titans: each sample starts from a fresh memory state; a prompt longer than ``model.max_seq_len``
  is read in calls of ``max_seq_len`` tokens (whole MAC segments) carrying the memory state from
  call to call (``stream``; exact for MAC and LMM, MAG / MAL attention windows restart per call), so
  nothing is truncated;
* other models see a window (``window``): prompts longer than the context (``model.max_seq_len``; a
  Hugging Face model's ``max_position_embeddings``) minus the new tokens keep their last tokens and
  are counted as truncated. MemoryLlama blocks start every forward from M_0
  (:func:`fresh_memory_per_forward`); a hierarchical-memory model uses its generic memory.

Everything runs in one process, without DeepSpeed or a process group: the model is built from the
recipe, the checkpoint's weights are loaded strictly (:func:`memtrain.parallel.checkpoint.load_module_state`)
together with the memory bank, and the model runs in eval mode in fp32. The report is written as
JSON to ``<run dir of the checkpoint>/eval/<tag>.json`` (``--out`` elsewhere) and printed as a table
(:func:`format_table`).

Import cost: torch and numpy only; Streaming, sentence-transformers and the model code are imported
by the functions that use them.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from memtrain.config import Recipe, RecipeError, TitansConfig
from memtrain.errors import CheckpointError, DataError
from memtrain.launcher.eval_longctx import (  # noqa: F401 (re-exported)
    long_context_by_default,
    parse_tasks,
    parse_lengths,
    niah_depths,
    PromptEncoder,
    task_examples,
    stream_call_tokens,
    model_context,
    fresh_memory_per_forward,
    greedy_generate,
    run_long_context,
    long_context,
    long_context_lines,
    DEFAULT_TASKS,
    DEFAULT_TASK_SAMPLES,
    DEFAULT_MAX_NEW_TOKENS,
    TASK_BATCH_SIZE,
)

CHECKPOINT_KEY = "checkpoint"
BUCKETS = ("head", "torso", "tail")
PROBE_SEED = 0  # the builtin:longtail source is generated with seed 0 (memtrain.data.sources)
IGNORE_INDEX = -100


# --------------------------------------------------------------------------------------------------
# Command-line helpers


def split_checkpoint_override(overrides: Sequence[str]) -> tuple[list[str], Optional[str]]:
    """Take ``checkpoint=PATH`` out of the ``key=value`` overrides (it is not a recipe key; dotted keys
    such as ``checkpoint.keep_last=3`` stay). Returns (the other overrides, PATH or None)."""
    rest: list[str] = []
    path: Optional[str] = None
    for item in overrides:
        key, sep, value = item.partition("=")
        if sep and key.strip() == CHECKPOINT_KEY:
            if not value.strip():
                raise RecipeError("", "checkpoint= needs a path: a run directory or one of its "
                                  "checkpoints/global_stepN folders")
            path = value.strip()
        else:
            rest.append(item)
    return rest, path


# --------------------------------------------------------------------------------------------------
# Retrieval variants (Section 2.1 greedy descent; Section 4 blocking; Appendix J corruption)


def mode_names(depth: Optional[int]) -> list[str]:
    """The default modes: for a memory of ``depth`` p levels ``fetched``, ``generic``, ``blocked`` and
    ``corrupt_from_level_c`` for c = p .. 1 (Appendix J order, finest level first); ``["none"]`` for a
    memory-less model (``depth`` None)."""
    if depth is None:
        return ["none"]
    return ["fetched", "generic", "blocked"] + [f"corrupt_from_level_{c}" for c in range(depth, 0, -1)]


def corrupt_ids(ids: np.ndarray, branching: int, from_level: int) -> np.ndarray:
    """Appendix J: corrupt the cluster ids ``[n, p]`` (global per level, level l in [0, k^l)) from the
    1-based level ``from_level`` = c down to the finest level.

    Levels < c keep their ids; for every level l >= c the id becomes
    ``new_{l-1} * k + ((true_l mod k) + 1) mod k`` with ``new_0 = 0`` (the root) for c = 1 and
    ``new_{c-1} = true_{c-1}`` otherwise. The result is a valid tree path (each id is a child of the
    one above it) that differs from the true path at every level >= c."""
    ids = np.asarray(ids, np.int64)
    if ids.ndim != 2:
        raise ValueError(f"ids must be [n, depth], got shape {ids.shape}")
    depth, k = ids.shape[1], branching
    if not 1 <= from_level <= depth:
        raise ValueError(f"from_level must lie in [1, {depth}], got {from_level}")
    out = ids.copy()
    parent = np.zeros(len(ids), np.int64) if from_level == 1 else ids[:, from_level - 2]
    for level in range(from_level - 1, depth):
        parent = parent * k + (ids[:, level] % k + 1) % k
        out[:, level] = parent
    return out


def blocked_ids(tree: Any, embeddings: np.ndarray) -> np.ndarray:
    """Section 4, Fig. 6b: retrieval with the best-matching level-1 subtree blocked (1/k of the bank).

    At level 1 the second-closest root centroid (L2; ties broken by the lowest index, as the greedy
    descent does) is taken instead of the closest; below it the descent is greedy
    (:meth:`ClusterTree.descend`). ``embeddings [n, dim]`` are L2-normalised first; returns ``[n, p]``
    global ids."""
    from memtrain.data.cluster import normalize

    x = np.asarray(embeddings)
    if x.ndim != 2 or x.shape[1] != tree.dim:
        raise ValueError(f"expected embeddings [n, {tree.dim}], got shape {x.shape}")
    x = normalize(x, np.float64)
    k = tree.branching
    root = tree.centroids[0].astype(np.float64)  # [k, dim]: the children of the root
    dist = np.einsum("kd,kd->k", root, root)[None, :] - 2.0 * (x @ root.T)
    node = np.argsort(dist, axis=1, kind="stable")[:, 1].astype(np.int64)
    ids = np.empty((len(x), tree.depth), np.int64)
    ids[:, 0] = node
    for level in range(1, tree.depth):
        node = node * k + tree.descend(x, level, node)
        ids[:, level] = node
    return ids


def mode_ids(mode: str, fetched: np.ndarray, blocked: Optional[np.ndarray], branching: int) -> Optional[np.ndarray]:
    """The ids a probe mode fetches: ``fetched`` and ``corrupt_from_level_c`` from the retrieved ids,
    ``blocked`` from :func:`blocked_ids`; None for ``generic`` and ``none``."""
    if mode == "fetched":
        return fetched
    if mode == "blocked":
        return blocked
    if mode.startswith("corrupt_from_level_"):
        return corrupt_ids(fetched, branching, int(mode.rsplit("_", 1)[1]))
    return None


# --------------------------------------------------------------------------------------------------
# Memory for a batch


def batch_memory(bank: Any, mode: str, batch_size: int, ids: Optional[torch.Tensor], device: torch.device):
    """The ``memory`` argument of the model for one batch: the bank's rows for ``ids [B, p]``
    (fetched, blocked, corrupted; evaluation fetches are not counted), the generic memory for every
    sequence (``generic``, Section 4), or None (``none``: the anchor alone)."""
    if mode == "none":
        return None
    from memtrain.model.hierarchical import FetchedMemory

    if mode == "generic":
        return FetchedMemory.all_generic(batch_size, bank.layout.depth, device)
    if ids is None:
        raise ValueError(f"memory mode {mode!r} needs cluster ids")
    return bank.fetch(ids.to(device), count=False)


# --------------------------------------------------------------------------------------------------
# Teacher-forced probe scoring


def probe_tokens(tokenizer: Any, prompts: Sequence[str], answers: Sequence[str]) -> tuple[list[list[int]], list[int]]:
    """Token ids of ``prompt + answer`` and the first answer position ``c``: the length of the common
    prefix of ``encode(prompt + answer)`` and ``encode(prompt)`` (a tokenizer may merge across the
    boundary, so the answer is whatever the full encoding adds to the prompt's)."""
    full = tokenizer.encode_batch([p + a for p, a in zip(prompts, answers)])
    alone = tokenizer.encode_batch(list(prompts))
    starts = []
    for f, p in zip(full, alone):
        c = 0
        for a, b in zip(f, p):
            if a != b:
                break
            c += 1
        starts.append(c)
    return [list(map(int, f)) for f in full], starts


@torch.no_grad()
def score_sequences(model: torch.nn.Module, sequences: Sequence[Sequence[int]], starts: Sequence[int],
                    memory_fn: Callable[[np.ndarray], Any] = lambda idx: None, batch_size: int = 64,
                    device: torch.device | str = "cpu", pad_id: int = 0,
                    max_len: Optional[int] = None) -> np.ndarray:
    """Teacher-forced greedy exact match (the Appendix B task's metric, without generation).

    ``sequences[i]`` are the tokens of prompt + answer and ``starts[i]`` = c the first answer position;
    probe i is correct when ``argmax logits[t - 1] == tokens[t]`` for every answer position t in
    c..len-1, which holds exactly when greedy generation from the prompt produces the answer's tokens
    first. Batches are right-padded with ``pad_id`` (causal attention: padding after a sequence never
    changes its logits) and run with one forward each; ``memory_fn(indices)`` gives the ``memory``
    argument for the probes ``indices`` of a batch. ``max_len``: longer sequences keep their last
    ``max_len`` tokens (the answer must fit). Probes with no answer token, or whose answer starts at
    position 0 (nothing to predict it from), count as incorrect. Returns a bool array."""
    n = len(sequences)
    if len(starts) != n:
        raise ValueError(f"{n} sequences but {len(starts)} start positions")
    seqs, cs = [], []
    for s, c in zip(sequences, starts):
        s = list(s)
        if max_len is not None and len(s) > max_len:
            cut = len(s) - max_len
            s, c = s[cut:], max(0, c - cut)
        seqs.append(s)
        cs.append(c)
    correct = np.zeros(n, bool)
    device = torch.device(device)
    for lo in range(0, n, batch_size):
        idx = np.arange(lo, min(n, lo + batch_size))
        lengths = torch.tensor([len(seqs[i]) for i in idx])
        T = int(lengths.max()) if len(idx) else 0
        if T < 2:
            continue
        tokens = torch.full((len(idx), T), pad_id, dtype=torch.long)
        for row, i in enumerate(idx):
            tokens[row, :len(seqs[i])] = torch.tensor(seqs[i], dtype=torch.long)
        c = torch.tensor([cs[i] for i in idx])
        out = model(tokens.to(device), doc_ids=None, memory=memory_fn(idx))
        pred = out.logits[:, :-1].argmax(-1).cpu()  # pred[:, t - 1] predicts tokens[:, t]
        target = tokens[:, 1:]
        t = torch.arange(1, T)[None, :]
        answer = (t >= c[:, None]) & (t < lengths[:, None]) & (c[:, None] >= 1)
        wrong = ((pred != target) & answer).any(dim=1)
        correct[idx] = (~wrong & answer.any(dim=1)).numpy()
    return correct


def accuracy_table(correct: np.ndarray, buckets: Sequence[str], kinds: Sequence[str]) -> dict[str, Any]:
    """Accuracy with counts overall, per frequency bucket (head / torso / tail) and per probe kind:
    ``{"all": {"accuracy", "correct", "count"}, "buckets": {...}, "kinds": {...}}`` (accuracy None
    for an empty group)."""
    correct = np.asarray(correct, bool)

    def cell(mask: np.ndarray) -> dict[str, Any]:
        count, right = int(mask.sum()), int(correct[mask].sum())
        return {"accuracy": right / count if count else None, "correct": right, "count": count}

    buckets, kinds = np.asarray(buckets), np.asarray(kinds)
    return {"all": cell(np.ones(len(correct), bool)),
            "buckets": {b: cell(buckets == b) for b in BUCKETS},
            "kinds": {k: cell(kinds == k) for k in sorted(set(kinds.tolist()))}}


# --------------------------------------------------------------------------------------------------
# Loading


def pick_device(recipe: Recipe) -> torch.device:
    """cuda when one is visible and ``run.device`` allows it (auto, cuda), else cpu; ``run.device: cuda``
    without a GPU is a LaunchError."""
    from memtrain.launcher.dist import DistEnv, resolve_device

    return resolve_device(recipe.run.device, DistEnv(0, 0, 1, 1, "127.0.0.1", 0, "single"))


def find_checkpoint(recipe: Recipe, path: Optional[str | Path] = None) -> Any:
    """The checkpoint to evaluate: ``path`` (a run dir or a ``checkpoints/global_stepN`` folder) or the
    newest complete checkpoint in ``run.dir``; CheckpointError when there is none."""
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
# The two evaluations


@torch.no_grad()
def val_perplexity(model: torch.nn.Module, bank: Any, recipe: Recipe, modes: Sequence[str], batches: int,
                   device: torch.device) -> dict[str, dict[str, Any]]:
    """exp(mean token loss) over the first ``batches`` micro-batches of the val split (not shuffled),
    per memory mode (``fetched``: each sequence's own cluster ids from prepare; ``generic``; ``none``).
    Every mode reads the same batches. Returns ``{mode: {"perplexity", "loss", "tokens", "batches"}}``."""
    from memtrain.data.loader import build_loader

    loader = build_loader(recipe, "val", recipe.train.micro_batch_size, shuffle=False)
    sums = {m: 0.0 for m in modes}
    tokens, seen = 0, 0
    for i, batch in enumerate(loader):
        if i >= batches:
            break
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch["labels"]
        n = int((labels != IGNORE_INDEX).sum())
        for mode in modes:
            memory = batch_memory(bank, mode, labels.shape[0], batch.get("cluster_ids"), device)
            logits = model(batch["input_ids"], doc_ids=batch["doc_ids"], memory=memory).logits
            sums[mode] += float(F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                ignore_index=IGNORE_INDEX, reduction="sum"))
        tokens += n
        seen += 1
    out = {}
    for mode in modes:
        loss = sums[mode] / tokens if tokens else float("nan")
        out[mode] = {"perplexity": _exp(loss), "loss": loss, "tokens": tokens, "batches": seen}
    return out


def _exp(x: float) -> float:
    try:
        return math.exp(x)
    except OverflowError:
        return float("inf")


def retrieve_probe_ids(recipe: Recipe, data_dir: Path, meta: dict,
                       prompts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Section 2.1 / Appendix B: embed every prompt with ``data.clustering.embedding_model`` and descend
    the prepared tree (``<data_dir>/tree.safetensors``); returns (greedy ids, ids with the best level-1
    subtree blocked), both ``[n, p]``."""
    from memtrain.data import embed
    from memtrain.data.cluster import ClusterTree

    cl = recipe.data.clustering
    tree_file = data_dir / (meta.get("clustering") or {}).get("tree", "tree.safetensors")
    if not tree_file.is_file():
        raise DataError(f"{data_dir} holds no cluster tree ({tree_file.name}); prepare the data with "
                        "data.clustering.enabled: true (`memtrain prepare RECIPE --force`)")
    embedder = embed.load_embedder(cl.embedding_model)
    emb = embed.embed_texts(list(prompts), embedder, cl.embedding_batch_size)
    tree = ClusterTree.load(tree_file, expect_branching=cl.branching, expect_depth=cl.depth, expect_dim=emb.shape[1])
    return tree.assign(emb), blocked_ids(tree, emb)


def probe_accuracy(model: torch.nn.Module, bank: Any, recipe: Recipe, data_dir: Path, meta: dict,
                   modes: Sequence[str], device: torch.device, batch_size: int = 64) -> dict[str, Any]:
    """Accuracy on every probe of ``longtail.probes(seed=0)`` per mode (see the module docstring)."""
    from memtrain.data import longtail
    from memtrain.data.tokenizer import load_tokenizer

    probes = longtail.probes(seed=PROBE_SEED)
    tokenizer = load_tokenizer(meta["tokenizer"], base=data_dir)
    sequences, starts = probe_tokens(tokenizer, [p.prompt for p in probes], [p.answer for p in probes])
    buckets, kinds = [p.bucket for p in probes], [p.kind for p in probes]
    fetched = blocked = None
    if any(m not in ("generic", "none") for m in modes):
        fetched, blocked = retrieve_probe_ids(recipe, data_dir, meta, [p.prompt for p in probes])
    results: dict[str, Any] = {}
    for mode in modes:
        ids = mode_ids(mode, fetched, blocked, recipe.data.clustering.branching) if fetched is not None else None
        ids_t = torch.from_numpy(ids) if ids is not None else None

        def memory_fn(idx: np.ndarray, mode=mode, ids_t=ids_t):
            return batch_memory(bank, mode, len(idx), ids_t[idx] if ids_t is not None else None, device)

        correct = score_sequences(model, sequences, starts, memory_fn, batch_size, device,
                                  pad_id=int(tokenizer.eot_id), max_len=recipe.model.max_seq_len)
        results[mode] = accuracy_table(correct, buckets, kinds)
    return {"count": len(probes), "seed": PROBE_SEED,
            "buckets": {b: buckets.count(b) for b in BUCKETS}, "modes": results}


# --------------------------------------------------------------------------------------------------
# Entry point


def check_modes(modes: Sequence[str], depth: Optional[int]) -> list[str]:
    """Validate requested modes; RecipeError for memory modes on a memory-less model or unknown names."""
    known = set(mode_names(depth)) | {"none"}
    modes = list(dict.fromkeys(modes))
    if depth is None:
        wrong = [m for m in modes if m != "none"]
        if wrong:
            raise RecipeError("memory.type", f"is 'none', so the model has no memories to evaluate with mode(s) "
                              f"{', '.join(wrong)}; only 'none' applies (or set memory.* as the run was trained)")
    unknown = [m for m in modes if m not in known]
    if unknown:
        raise RecipeError("", f"unknown eval mode(s) {', '.join(unknown)}; choose from {', '.join(sorted(known))}")
    if not modes:
        raise RecipeError("", "no eval modes given")
    return modes


def check_long_context(recipe: Recipe, tasks: Optional[str | Sequence[str]], lengths: Optional[str | Sequence[int]],
                       samples: Optional[int], max_new_tokens: Optional[int]) -> tuple[list[str], list[int], int, int]:
    """The long-context settings of an evaluation: (task names, lengths, samples, max new tokens).
    ``tasks`` None: ``niah,babilong`` for :func:`long_context_by_default` models, none otherwise.
    RecipeError for unknown tasks, bad lengths, counts < 1, or settings given with no task to run."""
    if tasks is None:
        names = parse_tasks(DEFAULT_TASKS) if long_context_by_default(recipe) else []
    else:
        names = parse_tasks(tasks)
    given = [flag for flag, value in (("--lengths", lengths), ("--samples", samples),
                                      ("--max-new-tokens", max_new_tokens)) if value is not None]
    if not names and given:
        why = ("--tasks none" if tasks is not None else
               f"model.type {recipe.model.type!r} runs them only when --tasks is given, e.g. --tasks niah,babilong")
        raise RecipeError("", f"{', '.join(given)} set, but no long-context task runs ({why})")
    lengths_out = parse_lengths(lengths)
    samples = DEFAULT_TASK_SAMPLES if samples is None else int(samples)
    max_new = DEFAULT_MAX_NEW_TOKENS if max_new_tokens is None else int(max_new_tokens)
    if samples < 1:
        raise RecipeError("", f"--samples must be >= 1, got {samples}")
    if max_new < 1:
        raise RecipeError("", f"--max-new-tokens must be >= 1, got {max_new}")
    return names, lengths_out, samples, max_new


def evaluate(recipe: Recipe, checkpoint: Optional[str | Path] = None, batches: Optional[int] = None,
             out: Optional[str | Path] = None, modes: Optional[Sequence[str]] = None,
             probe_batch_size: int = 64, tasks: Optional[str | Sequence[str]] = None,
             lengths: Optional[str | Sequence[int]] = None, samples: Optional[int] = None,
             max_new_tokens: Optional[int] = None, task_batch_size: int = TASK_BATCH_SIZE) -> dict[str, Any]:
    """Evaluate a checkpoint of ``recipe``'s run and write the JSON report; returns the report with
    ``"path"`` (where it was written).

    ``checkpoint``: a run dir or a ``global_stepN`` folder (default: the newest complete checkpoint in
    ``run.dir``). ``batches``: val micro-batches for perplexity (default ``train.eval.batches``; 0
    skips it). ``out``: the JSON file (default ``<run dir>/eval/<tag>.json``, the run dir that holds
    the checkpoint). ``modes``: default :func:`mode_names`. ``tasks``, ``lengths``, ``samples``,
    ``max_new_tokens``: the long-context tasks (:func:`check_long_context`, :func:`run_long_context`).
    Every user error (data not prepared, no or incompatible checkpoint, memory modes without memories,
    unknown tasks) is raised before anything is written."""
    from memtrain.data.loader import data_location, read_meta
    from memtrain.parallel import checkpoint as ckpt

    start = time.perf_counter()
    data_dir, _ = data_location(recipe)
    meta = read_meta(data_dir, recipe)  # DataError when `memtrain prepare` has not run
    if meta["vocab_size"] > recipe.model.vocab_size and recipe.model.type != "hf":
        raise RecipeError("model.vocab_size", f"{recipe.model.vocab_size} is smaller than the tokenizer's "
                          f"{meta['vocab_size']} tokens in {recipe.data_dir}")
    depth = recipe.data.clustering.depth if recipe.memory.enabled else None  # hierarchical memories only
    modes = check_modes(modes if modes is not None else mode_names(depth), depth)
    if batches is None:
        batches = recipe.train.eval.batches
    if batches < 0:
        raise RecipeError("train.eval.batches", f"must be >= 0, got {batches}")
    task_names, task_lengths, task_samples, max_new = check_long_context(recipe, tasks, lengths, samples,
                                                                         max_new_tokens)
    info = find_checkpoint(recipe, checkpoint)
    state = ckpt.read_trainer_state(info)
    ckpt.check_compatible(info, state, recipe, info.world_size)
    examples, tokenizer, encoder = [], None, None
    if task_names:
        from memtrain.data.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(meta["tokenizer"], base=data_dir)
        encoder = PromptEncoder(tokenizer)
        examples = task_examples(task_names, task_lengths, task_samples, encoder)
    device = pick_device(recipe)
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
    ppl_modes = [m for m in modes if m in ("fetched", "generic", "none")]
    report["perplexity"] = {}
    if batches > 0 and ppl_modes and meta.get("val_samples", 0) > 0:
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


def write_json_atomic(path: Path, data: dict) -> None:
    """Write ``data`` as JSON through a temporary file and a rename (readers never see half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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

__all__ = [
    "PromptEncoder", "accuracy_table", "batch_memory", "blocked_ids", "check_long_context", "check_modes",
    "corrupt_ids", "evaluate", "find_checkpoint", "format_table", "fresh_memory_per_forward", "greedy_generate",
    "load_model", "long_context", "long_context_by_default", "long_context_lines", "mode_ids", "mode_names",
    "model_context", "niah_depths", "parse_lengths", "parse_tasks", "pick_device", "probe_accuracy", "probe_tokens",
    "retrieve_probe_ids", "run_long_context", "score_sequences", "split_checkpoint_override", "stream_call_tokens",
    "task_examples", "val_perplexity", "write_json_atomic",
]
