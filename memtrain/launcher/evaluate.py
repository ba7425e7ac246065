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

import contextlib
import functools
import json
import math
import os
import re
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from memtrain.config import Recipe, RecipeError, TitansConfig
from memtrain.errors import CheckpointError, DataError

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
# Long-context tasks: S-NIAH and BABILong-style qa1-qa5 (memtrain.model.titans.eval_tasks), greedy


TASK_GROUPS = {"niah": ("passkey", "number", "word"), "babilong": ("qa1", "qa2", "qa3", "qa4", "qa5")}
DEFAULT_TASKS = ("niah", "babilong")
DEFAULT_TASK_LENGTHS = (512, 1024)  # tokens; sized for the tiny CPU models (the Titans paper: 2K-16K)
DEFAULT_TASK_SAMPLES = 5
DEFAULT_MAX_NEW_TOKENS = 16
TASK_SEED = 0
TASK_BATCH_SIZE = 8
LOGITS_BUDGET = 2 * 2**30  # bytes of fp32 logits one generation forward may produce (caps the batch)


def long_context_by_default(recipe: Recipe) -> bool:
    """``model.type: titans`` and ``memory.type: memory_llama`` runs are evaluated on the long-context
    tasks unless ``--tasks none``; other models only when ``--tasks`` is given."""
    return recipe.model.type == "titans" or recipe.memory.type == "memory_llama"


def parse_tasks(spec: Optional[str | Sequence[str]]) -> list[str]:
    """Task names from ``"niah,babilong"``-style input: the groups ``niah`` (passkey, number, word) and
    ``babilong`` (qa1-qa5) or single task names, in order, without repeats; ``none`` (or nothing) is
    no task. RecipeError for unknown names."""
    from memtrain.model.titans.eval_tasks import TASKS

    items = spec.split(",") if isinstance(spec, str) else list(spec or [])
    out: list[str] = []
    for item in (str(i).strip().lower() for i in items):
        if not item or item == "none":
            continue
        if item in TASK_GROUPS:
            out += TASK_GROUPS[item]
        elif item in TASKS:
            out.append(item)
        else:
            raise RecipeError("", f"unknown long-context task {item!r} in --tasks; choose from niah, babilong, "
                              f"{', '.join(TASKS)} or none")
    return list(dict.fromkeys(out))


def parse_lengths(spec: Optional[str | Sequence[int]]) -> list[int]:
    """Prompt lengths in tokens from ``"512,1024"`` (``2K`` = 2048, as in RULER); RecipeError unless
    every one is a whole number >= 64."""
    items = spec.split(",") if isinstance(spec, str) else list(spec if spec is not None else DEFAULT_TASK_LENGTHS)
    out = []
    for item in items:
        text = str(item).strip()
        if not text:
            continue
        m = re.fullmatch(r"(\d+)\s*([kK])?", text)
        if m is None:
            raise RecipeError("", f"--lengths: {text!r} is not a whole number of tokens (e.g. 512,1024 or "
                              "2K,4K,8K,16K)")
        n = int(m.group(1)) * (1024 if m.group(2) else 1)
        if n < 64:
            raise RecipeError("", f"--lengths: {n} is too short for the tasks' prompts; use 64 tokens or more")
        out.append(n)
    if not out:
        raise RecipeError("", "--lengths is empty; give prompt lengths in tokens, e.g. 512,1024")
    return list(dict.fromkeys(out))


def niah_depths(samples: int) -> list[float]:
    """Needle depths for ``samples`` S-NIAH examples per task and length: evenly spaced over [0, 1]
    (0.5 for one sample)."""
    if samples == 1:
        return [0.5]
    return [round(i / (samples - 1), 4) for i in range(samples)]


class PromptEncoder:
    """Token ids of a prompt with the run's tokenizer: memtrain's SentencePiece model as the training
    data was tokenized (no BOS); a Hugging Face tokenizer gets its BOS first when it adds one by default
    (Llama's does), as pretrained models expect. ``count`` is the length without the BOS (the generator
    measures haystack units with it)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.prefix: list[int] = []
        tok = getattr(tokenizer, "tok", None)  # memtrain.data.tokenizer.HFTokenizer
        bos = getattr(tok, "bos_token_id", None)
        if tok is not None and bos is not None:
            try:
                first = tok("a").input_ids[:1]
            except Exception:  # pragma: no cover - exotic tokenizers
                first = []
            if first == [bos]:
                self.prefix = [int(bos)]
        self._count = functools.lru_cache(maxsize=1 << 16)(lambda s: len(tokenizer.encode(s)))

    def count(self, text: str) -> int:
        return self._count(text) if len(text) <= 4096 else len(self.tokenizer.encode(text))

    def encode(self, text: str) -> list[int]:
        return self.prefix + [int(t) for t in self.tokenizer.encode(text)]


def task_examples(tasks: Sequence[str], lengths: Sequence[int], samples: int, encoder: PromptEncoder,
                  seed: int = TASK_SEED) -> list[dict]:
    """``samples`` examples per task and length (:func:`memtrain.model.titans.eval_tasks.generate`, whose
    prompts fit ``length`` tokens of ``encoder``): S-NIAH with its needles at :func:`niah_depths`,
    BABILong with the facts where they land. Deterministic in the arguments."""
    from memtrain.model.titans.eval_tasks import NIAH_TASKS, generate

    extra = len(encoder.prefix)
    out = []
    for task in tasks:
        for length in lengths:
            try:
                if task in NIAH_TASKS:
                    batch = generate(task, 1, lengths=[length - extra], depths=niah_depths(samples), seed=seed,
                                     length_fn=encoder.count)
                else:
                    batch = generate(task, samples, lengths=[length - extra], seed=seed, length_fn=encoder.count)
            except ValueError as e:
                need = re.search(r"\((\d+)\)", str(e))
                raise RecipeError("", f"--lengths: {length} tokens is too short for {task}'s question and facts"
                                  + (f" ({int(need.group(1)) + extra} tokens)" if need else f" ({e})")
                                  + f"; use longer lengths or leave {task} out of --tasks") from None
            for e in batch:
                e["length"], e["n_tokens"] = length, e["n_tokens"] + extra
            out += batch
    return out


def stream_call_tokens(model: torch.nn.Module) -> Optional[int]:
    """Titans models read long prompts in calls of this many tokens, carrying the memory state from
    one call to the next (:func:`greedy_generate`): ``model.max_seq_len`` rounded down to whole MAC
    segments (the carried state is then exact); None for other models."""
    from memtrain.model.titans.arch import TitansLM

    if not isinstance(model, TitansLM):
        return None
    n, t = model.cfg.max_seq_len, model.titans
    if t.variant == "mac" and n >= t.segment_len:
        n = n // t.segment_len * t.segment_len
    return n


def model_context(model: torch.nn.Module, recipe: Recipe) -> int:
    """The longest input the model takes: a Hugging Face model's ``max_position_embeddings`` (its
    pretrained context), else ``model.max_seq_len``."""
    if recipe.model.type == "hf":
        for module in model.modules():
            config = getattr(module, "config", None)
            if config is not None and not isinstance(config, type(recipe.model)):
                get = getattr(config, "get_text_config", None)
                config = get() if callable(get) else config
                n = getattr(config, "max_position_embeddings", None)
                if isinstance(n, int) and n > 0:
                    return n
    return recipe.model.max_seq_len


@contextlib.contextmanager
def fresh_memory_per_forward(model: torch.nn.Module) -> Iterator[None]:
    """MemoryLlama blocks (:mod:`memtrain.model.memory_llama`) in ``per_forward`` mode while generating
    without a KV cache: every forward re-reads its sample from the start, so it must start from the
    initial memory M_0 (``auto`` does the same for cache-less forwards; ``stream`` would carry the
    previous call's state). The blocks' modes are restored afterwards. No-op for other models."""
    from memtrain.model.memory_llama import GatedMemoryBlock

    blocks = [m for m in model.modules() if isinstance(m, GatedMemoryBlock)]
    modes = [b.mode for b in blocks]
    for b in blocks:
        b.mode = "per_forward"
        b.reset_memory()
    try:
        yield
    finally:
        for b, mode in zip(blocks, modes):
            b.mode = mode
            b.reset_memory()


def _batches(order: Sequence[int], lengths: Sequence[int], batch_size: int, max_rows_fn,
             same_length: bool) -> list[list[int]]:
    out: list[list[int]] = []
    for i in order:
        cur = out[-1] if out else None
        if (cur is not None and len(cur) < batch_size and (not same_length or lengths[cur[0]] == lengths[i])
                and len(cur) < max_rows_fn(lengths[cur[0]])):
            cur.append(i)
        else:
            out.append([i])
    return out


@torch.no_grad()
def greedy_generate(model: torch.nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int, eot_id: int,
                    max_context: int, *, stream_tokens: Optional[int] = None, batch_size: int = TASK_BATCH_SIZE,
                    memory_fn: Callable[[int], Any] = lambda n: None, device: torch.device | str = "cpu",
                    pad_id: Optional[int] = None, vocab_size: Optional[int] = None,
                    logits_budget: int = LOGITS_BUDGET) -> tuple[list[list[int]], list[bool]]:
    """Greedy decoding without a KV cache: each new token re-runs the model on the whole prefix (or, for
    a streamed model, on the part after its carried memory). Stops at ``eot_id`` (not returned) or after
    ``max_new_tokens``. Returns (new tokens per prompt, whether the prompt was truncated).

    - **window** (``stream_tokens`` None: decoders, Hugging Face models): a prompt longer than
      ``max_context - max_new_tokens + 1`` tokens keeps its last that many (left truncation, flagged),
      so every forward fits ``max_context``. Prompts are sorted by length and batched right-padded
      (``pad_id``, default ``eot_id``; the models are causal, so padding after a row never changes its
      logits); each row's next token is read at its own last position. ``memory_fn(batch)`` is the
      ``memory`` argument (e.g. the generic memory of a hierarchical-memory model).
    - **stream** (``stream_tokens`` = C: Titans): every sample starts from a fresh memory; while the
      unread part of a sequence exceeds ``max_context`` its first C tokens are run and the memory state
      the model returns (``output.memory``) is carried into the next call, so nothing is truncated.
      For MAC with C a multiple of the segment length the result equals one forward over the whole
      sequence; MAG / MAL sliding windows restart at each call (their memory state is exact). Prompts of
      equal length are batched (no padding).

    The batch is capped so that one forward's fp32 logits stay within ``logits_budget`` bytes
    (``vocab_size`` known)."""
    n = len(prompts)
    device = torch.device(device)
    pad = eot_id if pad_id is None else pad_id
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    if stream_tokens is None:
        budget = max_context - max_new_tokens + 1
        if budget < 1:
            raise ValueError(f"max_new_tokens {max_new_tokens} leaves no room for a prompt in {max_context} tokens")
        seqs = [list(map(int, p))[-budget:] for p in prompts]
        truncated = [len(p) > budget for p in prompts]
        span = lambda length: length + max_new_tokens - 1  # noqa: E731 - the longest forward of a row
    else:
        if not 1 <= stream_tokens <= max_context:
            raise ValueError(f"stream_tokens must lie in [1, {max_context}], got {stream_tokens}")
        seqs = [list(map(int, p)) for p in prompts]
        truncated = [False] * n
        span = lambda length: min(max_context, length + max_new_tokens - 1)  # noqa: E731
    if any(len(s) == 0 for s in seqs):
        raise ValueError("empty prompt")
    lengths = [len(s) for s in seqs]

    def max_rows(length: int) -> int:
        if not vocab_size:
            return batch_size
        return max(1, logits_budget // (4 * vocab_size * max(1, span(length))))

    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    outputs: list[list[int]] = [[] for _ in range(n)]
    for rows in _batches(order, lengths, batch_size, max_rows, same_length=stream_tokens is not None):
        if stream_tokens is None:
            _generate_window(model, rows, seqs, outputs, max_new_tokens, eot_id, pad, memory_fn, device)
        else:
            _generate_stream(model, rows, seqs, outputs, max_new_tokens, eot_id, max_context, stream_tokens,
                             device)
    return outputs, truncated


def _generate_window(model, rows, seqs, outputs, max_new_tokens, eot_id, pad, memory_fn, device) -> None:
    cur = {i: list(seqs[i]) for i in rows}
    active = list(rows)
    for _ in range(max_new_tokens):
        if not active:
            break
        lens = torch.tensor([len(cur[i]) for i in active])
        tokens = torch.full((len(active), int(lens.max())), pad, dtype=torch.long)
        for r, i in enumerate(active):
            tokens[r, :len(cur[i])] = torch.tensor(cur[i], dtype=torch.long)
        logits = model(tokens.to(device), doc_ids=None, memory=memory_fn(len(active))).logits
        nxt = logits[torch.arange(len(active), device=logits.device), (lens - 1).to(logits.device)].argmax(-1).tolist()
        still = []
        for i, t in zip(active, nxt):
            if t == eot_id:
                continue
            outputs[i].append(int(t))
            cur[i].append(int(t))
            still.append(i)
        active = still


def _generate_stream(model, rows, seqs, outputs, max_new_tokens, eot_id, max_context, call_tokens, device) -> None:
    seq = torch.tensor([seqs[i] for i in rows], dtype=torch.long, device=device)  # equal lengths
    state, done = None, [False] * len(rows)  # None: a fresh memory for every sample
    start = 0  # tokens already in the carried state
    for _ in range(max_new_tokens):
        while seq.shape[1] - start > max_context:
            state = model(seq[:, start:start + call_tokens], doc_ids=None, memory=state).memory
            start += call_tokens
        nxt = model(seq[:, start:], doc_ids=None, memory=state).logits[:, -1].argmax(-1)
        for r, t in enumerate(nxt.tolist()):
            if not done[r]:
                if t == eot_id:
                    done[r] = True
                else:
                    outputs[rows[r]].append(int(t))
        if all(done):
            break
        seq = torch.cat([seq, nxt[:, None].to(seq.dtype)], dim=1)


def _cell(hits: Sequence[bool], cut: Sequence[bool]) -> dict[str, Any]:
    count, right = len(hits), int(sum(hits))
    return {"accuracy": right / count if count else None, "correct": right, "count": count,
            "truncated": int(sum(cut))}


def run_long_context(model: torch.nn.Module, tokenizer: Any, examples: Sequence[dict], max_new_tokens: int,
                     max_context: int, *, stream_tokens: Optional[int] = None, batch_size: int = TASK_BATCH_SIZE,
                     memory_fn: Callable[[int], Any] = lambda n: None, device: torch.device | str = "cpu",
                     vocab_size: Optional[int] = None, encoder: Optional[PromptEncoder] = None) -> dict[str, Any]:
    """Tokenize each example's prompt (:func:`memtrain.model.titans.eval_tasks.format_prompt`), generate
    greedily (:func:`greedy_generate`; MemoryLlama blocks start every forward from M_0), decode and score
    (:func:`memtrain.model.titans.eval_tasks.score`, whole-word answer match). Returns accuracy with
    counts and truncated prompts overall, per task, per length, per task and length, per needle depth,
    and every example's prediction."""
    from memtrain.model.titans.eval_tasks import format_prompt, is_correct, score

    encoder = encoder or PromptEncoder(tokenizer)
    prompts = [encoder.encode(format_prompt(e)) for e in examples]
    eot = int(tokenizer.eot_id)
    with fresh_memory_per_forward(model):
        generated, truncated = greedy_generate(model, prompts, max_new_tokens, eot, max_context,
                                               stream_tokens=stream_tokens, batch_size=batch_size,
                                               memory_fn=memory_fn, device=device, vocab_size=vocab_size)
    predictions = [tokenizer.decode(g) if g else "" for g in generated]
    scored = score(predictions, examples)
    hits = [is_correct(p, e["answer"]) for p, e in zip(predictions, examples)]

    def cells(key: Callable[[dict], Any], where: Callable[[dict], bool] = lambda e: True) -> dict[str, Any]:
        groups: dict[str, tuple[list, list]] = {}
        for h, c, e in zip(hits, truncated, examples):
            if where(e):
                g = groups.setdefault(str(key(e)), ([], []))
                g[0].append(h)
                g[1].append(c)
        return {k: _cell(*v) for k, v in groups.items()}

    tasks = list(dict.fromkeys(e["task"] for e in examples))
    return {
        "all": _cell(hits, truncated),
        "by_task": cells(lambda e: e["task"]),
        "by_length": cells(lambda e: e["length"]),
        "by_task_length": {t: cells(lambda e: e["length"], lambda e, t=t: e["task"] == t) for t in tasks},
        "by_depth": {str(k): v for k, v in scored["by_depth"].items()},
        "truncated": int(sum(truncated)),
        "examples": [{"task": e["task"], "length": e["length"], "depth": e["depth"], "prompt_tokens": len(p),
                      "truncated": c, "answer": e["answer"], "prediction": pred[:200], "correct": h}
                     for e, p, c, pred, h in zip(examples, prompts, truncated, predictions, hits)],
    }


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


def long_context(model: torch.nn.Module, bank: Any, recipe: Recipe, tokenizer: Any, encoder: PromptEncoder,
                 examples: Sequence[dict], tasks: Sequence[str], lengths: Sequence[int], samples: int,
                 max_new_tokens: int, device: torch.device, batch_size: int = TASK_BATCH_SIZE) -> dict[str, Any]:
    """The ``long_context`` entry of the report: the settings and :func:`run_long_context`'s results.
    Titans models stream (:func:`stream_call_tokens`); others see a window of :func:`model_context`
    tokens; a hierarchical-memory model uses its generic memory (no retrieval for these prompts)."""
    t0 = time.perf_counter()
    stream = stream_call_tokens(model)
    max_context = recipe.model.max_seq_len if stream is not None else model_context(model, recipe)
    memory_fn: Callable[[int], Any] = lambda n: None  # noqa: E731
    if bank is not None:
        memory_fn = lambda n: batch_memory(bank, "generic", n, None, device)  # noqa: E731
        memory = "generic (the hierarchical memory's generic blocks; nothing is retrieved)"
    elif stream is not None:
        memory = "fresh per sample (the Titans memory state carried across calls within a sample)"
    elif recipe.memory.type == "memory_llama":
        memory = "fresh per sample (every forward starts from M_0)"
    else:
        memory = "none"
    vocab = getattr(model, "vocab_size", None) or recipe.model.vocab_size
    results = run_long_context(model, tokenizer, examples, max_new_tokens, max_context, stream_tokens=stream,
                               batch_size=batch_size, memory_fn=memory_fn, device=device, vocab_size=vocab,
                               encoder=encoder)
    from memtrain.model.titans.eval_tasks import NIAH_TASKS

    return {
        "tasks": list(tasks), "lengths": list(lengths), "samples": samples, "seed": TASK_SEED,
        "niah_depths": niah_depths(samples) if any(t in NIAH_TASKS for t in tasks) else [],
        "max_new_tokens": max_new_tokens, "length_unit": "tokens", "bos": bool(encoder.prefix),
        "context": {"mode": "stream" if stream is not None else "window", "max_context": max_context,
                    "call_tokens": stream,
                    "prompt_budget": None if stream is not None else max_context - max_new_tokens + 1},
        "memory": memory,
        **results,
        "seconds": round(time.perf_counter() - t0, 3),
    }


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


def long_context_lines(lc: dict[str, Any]) -> list[str]:
    """The long-context part of :func:`format_table`: accuracy (%) per task and length, per task, per
    length and overall, then how the prompts were fed."""
    lengths = [str(n) for n in lc["lengths"]]
    width = max(len("task"), *(len(t) for t in lc["tasks"]))

    def pct(cell: Optional[dict]) -> str:
        return f"{100 * cell['accuracy']:7.1f}%" if cell and cell.get("accuracy") is not None else f"{'-':>8}"

    lines = [f"long-context tasks (greedy, <= {lc['max_new_tokens']} new tokens, answer as a whole word); "
             f"accuracy by prompt length in tokens:",
             f"{'task':<{width}}  " + "  ".join(f"{n:>8}" for n in lengths) + f"  {'all':>8}"]
    for task in lc["tasks"]:
        row = lc["by_task_length"].get(task, {})
        lines.append(f"{task:<{width}}  " + "  ".join(pct(row.get(n)) for n in lengths)
                     + f"  {pct(lc['by_task'].get(task))}")
    lines.append(f"{'all':<{width}}  " + "  ".join(pct(lc["by_length"].get(n)) for n in lengths)
                 + f"  {pct(lc['all'])}")
    ctx = lc["context"]
    if ctx["mode"] == "stream":
        how = (f"read in calls of {ctx['call_tokens']} tokens with the memory carried between them "
               f"(nothing truncated)")
    else:
        how = (f"{lc['truncated']} left-truncated to {ctx['prompt_budget']} tokens to fit the model's "
               f"{ctx['max_context']}-token context")
    lines.append(f"prompts: {lc['all']['count']} ({lc['samples']} per task and length), {how}; memory: "
                 f"{lc['memory'].split(' (')[0]}; predictions in the JSON")
    return lines


__all__ = [
    "PromptEncoder", "accuracy_table", "batch_memory", "blocked_ids", "check_long_context", "check_modes",
    "corrupt_ids", "evaluate", "find_checkpoint", "format_table", "fresh_memory_per_forward", "greedy_generate",
    "load_model", "long_context", "long_context_by_default", "long_context_lines", "mode_ids", "mode_names",
    "model_context", "niah_depths", "parse_lengths", "parse_tasks", "pick_device", "probe_accuracy", "probe_tokens",
    "retrieve_probe_ids", "run_long_context", "score_sequences", "split_checkpoint_override", "stream_call_tokens",
    "task_examples", "val_perplexity", "write_json_atomic",
]
