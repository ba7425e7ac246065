"""Evaluation of hierarchical memories (Pouransari et al.): perplexity and fact probes per memory mode.

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

The command that loads a checkpoint and writes the report is :mod:`memtrain.eval.evaluate`.
Import cost: torch and numpy only; Streaming and sentence-transformers are imported by the functions
that use them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from memtrain.config import Recipe, RecipeError
from memtrain.errors import DataError
from memtrain.eval.common import (accuracy_cell, answer_start, batch_memory, length_batches, padding_changes_logits,
                                  right_padded)

BUCKETS = ("head", "torso", "tail")
PROBE_SEED = 0  # the builtin:longtail source is generated with seed 0 (memtrain.data.sources)
IGNORE_INDEX = -100


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


def check_modes(modes: Sequence[str], depth: Optional[int], memory_type: str = "none") -> list[str]:
    """Validate requested modes; RecipeError for memory modes on a model without cluster-fetched memories (its
    ``memory_type``: none, or a cross-attention bank its layers always read) or unknown names."""
    known = set(mode_names(depth)) | {"none"}
    modes = list(dict.fromkeys(modes))
    if depth is None:
        wrong = [m for m in modes if m != "none"]
        if wrong and memory_type not in ("none", ""):
            raise RecipeError("memory.type", f"is {memory_type!r}: mode(s) {', '.join(wrong)} choose, corrupt or block "
                              "the memories fetched by cluster id (hierarchical memories), which this model does not "
                              "have; its memory is part of every forward, so only mode 'none' (the model as trained) "
                              "applies")
        if wrong:
            raise RecipeError("memory.type", f"is 'none', so the model has no memories to evaluate with mode(s) "
                              f"{', '.join(wrong)}; only 'none' applies (or set memory.* as the run was trained)")
    unknown = [m for m in modes if m not in known]
    if unknown:
        raise RecipeError("", f"unknown eval mode(s) {', '.join(unknown)}; choose from {', '.join(sorted(known))}")
    if not modes:
        raise RecipeError("", "no eval modes given")
    return modes


# --------------------------------------------------------------------------------------------------
# Teacher-forced probe scoring


def probe_tokens(tokenizer: Any, prompts: Sequence[str], answers: Sequence[str]) -> tuple[list[list[int]], list[int]]:
    """Token ids of ``prompt + answer`` and the first answer position ``c``: the length of the common
    prefix of ``encode(prompt + answer)`` and ``encode(prompt)`` (a tokenizer may merge across the
    boundary, so the answer is whatever the full encoding adds to the prompt's)."""
    full = tokenizer.encode_batch([p + a for p, a in zip(prompts, answers)])
    alone = tokenizer.encode_batch(list(prompts))
    return [list(map(int, f)) for f in full], [answer_start(f, p) for f, p in zip(full, alone)]


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
    changes its logits) and run with one forward each; a model whose logits padding changes (sequence
    routing: :func:`~memtrain.eval.common.padding_changes_logits`) gets batches of equal-length sequences
    instead, no padding, so a probe's result never depends on the others in its batch. ``memory_fn(indices)``
    gives the ``memory`` argument for the probes ``indices`` of a batch. ``max_len``: longer sequences keep their last
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
    same_length = padding_changes_logits(model)
    order = sorted(range(n), key=lambda i: (len(seqs[i]), i)) if same_length else range(n)
    for rows in length_batches(order, [len(s) for s in seqs], batch_size, same_length):
        idx = np.asarray(rows, dtype=np.int64)
        tokens, lengths = right_padded([seqs[i] for i in idx], pad_id)
        T = tokens.shape[1]
        if T < 2:
            continue
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
        return accuracy_cell(correct[mask].tolist())

    buckets, kinds = np.asarray(buckets), np.asarray(kinds)
    return {"all": cell(np.ones(len(correct), bool)),
            "buckets": {b: cell(buckets == b) for b in BUCKETS},
            "kinds": {k: cell(kinds == k) for k in sorted(set(kinds.tolist()))}}


# --------------------------------------------------------------------------------------------------
# The two evaluations


@torch.no_grad()
def val_perplexity(model: torch.nn.Module, bank: Any, recipe: Recipe, modes: Sequence[str], batches: int,
                   device: torch.device) -> dict[str, dict[str, Any]]:
    """exp(token-weighted mean loss) over the validation sequences training validates on
    (:class:`memtrain.data.loader.ValidationSet`: ``batches`` micro-batches' worth evenly spaced over the
    val split, 0 = all of it), per memory mode (``fetched``: each sequence's own cluster ids from
    prepare; ``generic``; ``none``); so ``fetched`` equals the run's ``loss/val`` at the same weights.
    Every mode reads the same batches. Returns ``{mode: {"perplexity", "loss", "tokens", "batches"}}``."""
    from memtrain.data.loader import ValidationSet

    val_set = ValidationSet(recipe, recipe.train.micro_batch_size, batches=batches)
    sums = {m: 0.0 for m in modes}
    tokens = 0
    for batch in val_set:
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch["labels"]
        n = int((labels != IGNORE_INDEX).sum())
        for mode in modes:
            memory = batch_memory(bank, mode, labels.shape[0], batch.get("cluster_ids"), device)
            logits = model(batch["input_ids"], doc_ids=batch["doc_ids"], memory=memory).logits
            sums[mode] += float(F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                ignore_index=IGNORE_INDEX, reduction="sum"))
        tokens += n
    out = {}
    for mode in modes:
        loss = sums[mode] / tokens if tokens else float("nan")
        out[mode] = {"perplexity": _exp(loss), "loss": loss, "tokens": tokens, "batches": len(val_set)}
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
    from memtrain.data.verify import prepared_file

    cl = recipe.data.clustering
    # checked against meta.json's size and checksum (fetched first with data.remote)
    tree_file = prepared_file(data_dir, meta, (meta.get("clustering") or {}).get("tree", "tree.safetensors"),
                              recipe.data.remote)
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
    from memtrain.data.verify import prepared_tokenizer

    probes = longtail.probes(seed=PROBE_SEED)
    tokenizer = prepared_tokenizer(data_dir, meta, recipe.data.remote)
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


__all__ = [
    "BUCKETS", "IGNORE_INDEX", "PROBE_SEED", "accuracy_table", "blocked_ids", "check_modes", "corrupt_ids", "mode_ids",
    "mode_names", "probe_accuracy", "probe_tokens", "retrieve_probe_ids", "score_sequences", "val_perplexity",
]
