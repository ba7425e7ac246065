"""Communication of the row-sharded memory banks (memtrain.parallel.sharded_bank, and its chapter bank
memtrain.parallel.chapter_bank) against dense ZeRO-3.

Five parts, in JSON lines (``"kind"`` says which; parts 1-4 are the hierarchical bank, 5 the
cross-attention bank, ``--only hierarchical`` / ``--only chapter_bank`` runs one of the two):

1. ``"measured"``: W = 2 and 4 gloo processes on CPU run a few training steps of a
   :class:`ShardedMemoryBank` for the paper's two bank configurations, levels (256, 64, 16, 0) on the
   160M anchor and (768, 256, 16, 0) on the 1.4B anchor (k = 16, p = 4), *scaled to fit*: the anchor
   is shrunk (d_model / 32 and 1 layer with ``--quick``; d_model / 16 and 1 layer otherwise) while the
   level multipliers, k and p stay, so every level keeps its k^l rows and only the row width
   s_l = c0 r_l shrinks. Each rank draws ``--micro-batch`` sequences' leaf ids uniformly over k^p
   leaves (seeded by step, rank and micro-batch), then ``fetch`` -> loss = sum of squares of the
   fetched rows (no model) -> backward -> ``reduce_gradients()`` -> ``step(lr)``. Reported per rank per
   step: the counted bytes (``comm_bytes()``: every all-to-all payload, self-sends excluded), the wall
   time of fetch + backward + reduce + step (after a barrier; step 0 is a warm-up and not timed), and
   ``zero3_reference_bytes`` (3 m (W-1)/W P 4: all-gather forward, all-gather backward,
   reduce-scatter, fp32). ``ratio_vs_zero3`` there is the measured one at that W.
2. The byte model :func:`predict_bytes` counts what ShardedMemoryBank sends from the layout, W and every
   rank's ids (it needs all ranks' ids: what a rank serves depends on what the others ask for). Every
   measured line carries ``model_matches_measured``: the prediction equals ``comm_bytes()`` exactly for
   every rank and step (the script fails otherwise).
3. ``"derived_64_ranks"``: the paper's global batch (1,024 sequences of 2,048 tokens per step, Appendix
   A.2) on 64 ranks is 16 sequences per rank per step (one micro-batch of 16), with the *full-size*
   layouts. Per-rank bank bytes come from the validated byte model (mean over ``--draws`` seeded draws
   of uniform leaf ids and over the 64 ranks; no real cluster-size distribution is available here, so
   the draws are uniform), ZeRO-3's from the same formula as ``zero3_reference_bytes``. Also with
   cluster-affine placement (``ratio_vs_zero3_affine``: 16 groups of 4 ranks, each group's sequences
   from its level-1 subtree and the rows owned within the group, :func:`affine_owner`). Headline
   ``ratio_vs_zero3`` = ZeRO-3 fp32 bytes / bank bytes as counted (the bank sends fp32 rows and
   gradients), per rank per step, mean over ranks (mean sent = mean received). Also reported: a bank
   with bf16 rows (``memory.bank_dtype: bf16``: rows fetched in bf16, gradients still fp32) against
   ZeRO-3 of the same bf16 bank (``ratio_vs_zero3_bf16_rows``), the busiest rank, the worst case
   (every sequence of a rank in a different cluster at every level) and the share of each level.
4. ``"cluster_assignment"`` (inside each derived line): the same 64-rank figures with leaf ids drawn
   from a cluster assignment instead of uniformly. With global placement and round-robin owners the
   busiest rank is the owner of the most requested level-1 row, so its bytes grow with the largest
   level-1 cluster's share. A synthetic corpus (:func:`synthetic_corpus`: Zipf-sized topics, no real
   embeddings here) is clustered by :func:`memtrain.data.cluster.train_tree` (k = 16, p = 4, the
   paper's balanced k-means) and assigned twice: by plain greedy descent (``memtrain prepare`` before
   the balanced assignment) and by :meth:`ClusterTree.assign_balanced` (now); sequences are drawn in
   proportion to the documents of each leaf. Each gives ``ratio_vs_zero3``,
   ``ratio_vs_zero3_busiest_rank`` and, for cluster-affine placement on 64 ranks, the share of the
   training data the busiest rank reads over the ideal 1/64 (from the report's
   :func:`memtrain.data.clustered.affine_busiest_rank`); ``ratio_vs_zero3_busiest_rank_greedy`` and
   ``..._balanced`` repeat the busiest-rank ratios at the top level. Uniform ids are the perfectly
   balanced case: no assignment does better than ``ratio_vs_zero3_busiest_rank`` there.
5. ``"chapter_bank"``: the sharded cross-attention bank (:class:`ShardedChapterBank`, a chapter is a row
   of a ShardedMemoryBank). ``"part": "measured"``: W = 2 and 4 gloo processes train one shared bank of
   1,000,000 latent tokens in C = 1,000 chapters of 1,000 tokens, its width scaled down to fit a CPU
   (8 with ``--quick``, 16 otherwise: ``"width_scaled": true``; only the bytes per chapter shrink),
   read by 4 memory layers with sequence-level routing: per micro-batch (``--micro-batch`` sequences,
   16 by default) and per layer, each sequence picks top-k = 16 distinct chapters uniformly (seeded by
   step, rank, micro-batch and layer, :func:`chapter_ids`) and the layer fetches the unique ones through
   ``ChapterBankView.chapters`` (the model's path: one fetch per layer per forward); loss = sum of
   squares of the fetched chapters -> backward -> ``reduce_gradients()`` -> ``step(lr)``. Reported per
   rank per step: the counted bytes sent and received (``comm_bytes()``), ``model_matches_measured``
   (:func:`predict_chapter_bytes` on every rank's ids equals them exactly for every rank and step; the
   script fails otherwise), ``zero3_reference_bytes`` (:func:`zero3_chapter_bytes`: the bank as a dense
   ZeRO-3 parameter, gathered once per micro-batch) and ``ratio_vs_zero3``, the routed shares (distinct
   chapters / C: a rank's per fetch and per step, all ranks' per step, the last checked against
   ``stats()``), and the time per step (slowest rank, median after a warm-up step). At the first W the
   same bank also runs with top-k 4: ``"part": "traffic_vs_routing"`` gives
   ``bytes_ratio_top16_vs_top4`` next to the ratio of routed chapters (the bank and ZeRO-3's bytes stay
   the same). ``"part": "derived_64_ranks"``: 64 ranks, the same bank at full width d = 1024 and 2048,
   top-k 10 and 20, 16 sequences per rank, 4 layers, one micro-batch: the expected bytes per rank per
   step of :func:`expected_chapter_bytes` (the byte model's formula with the expected distinct chapters
   per fetch and per step from ``expected_unique``; ``"formula"`` writes it out; the byte model's mean
   over ``--draws`` seeded draws is reported next to it) against ZeRO-3's of the same bank. Uniform
   routing is assumed (``"note"``); nothing of this part runs a model.

    python benchmarks/bank_comm.py --quick          # CPU, gloo, a few minutes
    python benchmarks/bank_comm.py --quick --only chapter_bank
    python benchmarks/bank_comm.py --world 2,4 --steps 6 --out bank_comm.jsonl

Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memtrain.config import MemoryConfig, ModelConfig  # noqa: E402
from memtrain.model.anchor import anchor_dims  # noqa: E402
from memtrain.model.hierarchical import MemoryLayout  # noqa: E402
from memtrain.parallel.chapter_bank import (expected_unique, predict_chapter_bytes,  # noqa: E402
                                            zero3_chapter_bytes)

K = 16  # branching
ANCHORS = {  # the paper's anchors (memtrain ModelConfig)
    "160M": ModelConfig(d_model=512, n_layers=35, n_heads=12, head_dim=32, ffn_dim=2048),
    "1.4B": ModelConfig(d_model=2048, n_layers=24, n_heads=16, ffn_dim=5632),
}
CONFIGS = [("160M", (256, 64, 16, 0)), ("1.4B", (768, 256, 16, 0))]
GLOBAL_BATCH_SEQS, SEQ_LEN, RANKS_64 = 1024, 2048, 64  # Appendix A.2
ID_BYTES = 8  # int64 ids and split sizes
LR = 1e-3


# --------------------------------------------------------------------------------------------------
# Layouts


def scaled_anchor(name: str, quick: bool) -> ModelConfig:
    """The anchor with d_model / 32 (quick) or / 16, one layer; heads and ffn scaled alike (an ffn
    memory's row width depends only on d_model and n_layers: s_l = 3 L d r_l)."""
    cfg = ANCHORS[name]
    div = 32 if quick else 16
    d = cfg.d_model // div
    heads = max(1, cfg.n_heads // div)
    return ModelConfig(d_model=d, n_layers=1, n_heads=heads, head_dim=max(1, d // heads),
                       ffn_dim=max(1, cfg.ffn_dim // div))


def build_layout(model_cfg: ModelConfig, levels) -> MemoryLayout:
    return MemoryLayout.build(MemoryConfig(type="ffn", levels=list(levels)), anchor_dims(model_cfg), K)


def layout_info(lay: MemoryLayout) -> dict:
    d = lay.dims
    return {"d_model": d.d_model, "n_layers": d.n_layers, "c0": lay.c0,
            "block_sizes": [lay.block_size(l) for l in range(lay.depth)],
            "rows": [lay.rows(l) if lay.levels[l] else 0 for l in range(lay.depth)],
            "fetched_params": lay.fetched_parameters, "bank_params": lay.bank_parameters}


def draw_ids(B: int, depth: int, gen: torch.Generator) -> torch.Tensor:
    """[B, depth] cluster ids of B leaves drawn uniformly over K^depth: level l's id = leaf // K^(p-l)."""
    leaf = torch.randint(0, K ** depth, (B,), generator=gen)
    return torch.stack([leaf // K ** (depth - 1 - l) for l in range(depth)], 1)


def micro_ids(step: int, rank: int, micro: int, B: int, depth: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + 100_003 * step + 101 * rank + micro)
    return draw_ids(B, depth, g)


def leaf_draw(probs: torch.Tensor, B: int, depth: int, gen: torch.Generator) -> torch.Tensor:
    """[B, depth] ids of B leaves drawn with probabilities ``probs [K^depth]`` (with replacement)."""
    leaf = torch.multinomial(probs, B, replacement=True, generator=gen)
    return torch.stack([leaf // K ** (depth - 1 - l) for l in range(depth)], 1)


# --------------------------------------------------------------------------------------------------
# Cluster assignments of a synthetic corpus


def synthetic_corpus(n: int, dim: int = 32, seed: int = 0, domains: int = 32, topics: int = 16, zipf: float = 1.0,
                     noise: float = 0.3) -> np.ndarray:
    """``n`` document embeddings with Zipf-sized topics: ``domains`` random unit directions with
    weights ~ 1/rank^zipf, each with ``topics`` sub-directions (weights alike, offset 0.5) and Gaussian
    noise of norm about ``noise``. Dense popular topics are what makes the greedy descent overload a
    cluster (the paper's balancing acts on the training samples, not on the final split)."""
    rng = np.random.default_rng(seed)

    def unit(*shape: int) -> np.ndarray:
        v = rng.normal(size=(*shape, dim))
        return v / np.linalg.norm(v, axis=-1, keepdims=True)

    def zipf_weights(m: int) -> np.ndarray:
        w = 1.0 / np.arange(1, m + 1) ** zipf
        return w / w.sum()

    centres, offsets = unit(domains), unit(domains, topics)
    d = rng.choice(domains, size=n, p=zipf_weights(domains))
    t = rng.choice(topics, size=n, p=zipf_weights(topics))
    x = centres[d] + 0.5 * offsets[d, t] + noise * rng.normal(size=(n, dim)) / np.sqrt(dim)
    return x.astype(np.float32)


def cluster_assignments(n: int, steps: int, samples: int, depth: int = 4, balance_factor: float = 1.5,
                        seed: int = 0) -> dict:
    """Train a K-ary tree of ``depth`` levels on :func:`synthetic_corpus` and assign its documents by
    greedy descent and by the balanced descent; per assignment the leaf probabilities (documents per
    leaf / n), the largest child's share of its parent per level and the busiest rank under
    cluster-affine placement on 64 ranks (documents per level-1 subtree as its samples)."""
    from memtrain.data.cluster import balance_report, train_tree
    from memtrain.data.clustered import affine_busiest_rank

    t0 = time.perf_counter()
    x = synthetic_corpus(n, seed=seed)
    tree = train_tree(x, K, depth, steps=steps, samples=samples, balance_factor=balance_factor, seed=seed,
                      progress=False)
    out: dict = {"documents": n, "tree_steps": steps, "tree_samples": samples, "balance_factor": balance_factor,
                 "limit": balance_factor / K}
    greedy = tree.assign(x)
    for name, ids in (("greedy", greedy), ("balanced", tree.assign_balanced(x, balance_factor))):
        counts = np.bincount(ids[:, -1], minlength=K ** depth)
        subtrees = counts.reshape(K, -1).sum(axis=1)
        affine = affine_busiest_rank({s: int(c) for s, c in enumerate(subtrees)}, K, balance_factor, (RANKS_64,))[0]
        out[name] = {"probs": torch.from_numpy(counts / n),
                     "max_share_of_parent": [round(v, 4) for v in balance_report(ids, K)["max_cluster_fraction"]],
                     "affine_64_busiest_rank_share_over_ideal": affine["ratio_to_ideal"]}
        if name == "balanced":
            out[name]["documents_moved_from_greedy"] = round(float(np.mean(ids[:, -1] != greedy[:, -1])), 4)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


# --------------------------------------------------------------------------------------------------
# The byte model


def predict_bytes(lay: MemoryLayout, world: int, ids, row_bytes: int = 4, id_bytes: int = ID_BYTES,
                  owner=None, grad_bytes: int = 4) -> list[dict]:
    """Bank bytes each rank sends and receives in one step, as ShardedMemoryBank counts them.

    ``ids[r][m]``: rank r's ``[B, p]`` cluster ids of micro-batch m (no generic sequences; every fetched
    row gets a gradient). Owner of row g = g % world, or ``owner(level, ids)`` (e.g. the affine map of
    :func:`affine_owner`). Self-sends are excluded. Per active level
    (r_l > 0), per micro-batch (fetch), with U_r = rank r's unique ids of the level:

    - split sizes: one int64 to every other rank, and one from each: (W-1) * 8 each way;
    - id requests: a_r = |{g in U_r: owner(g) != r}| ids sent; b_r = sum_{q != r} |{g in U_q:
      owner(g) = r}| ids received;
    - rows: owners answer, so rank r sends b_r rows and receives a_r rows of s_l * ``row_bytes`` bytes
      (the storage dtype: 4 fp32, 2 bf16).

    Per active level at ``reduce_gradients`` (once per step), with U_r = the union of rank r's unique
    ids over the step's micro-batches: split sizes as above, then a_r ids and a_r gradient rows sent,
    b_r ids and b_r rows received (gradients always fp32: s_l * ``grad_bytes`` = 4 bytes a row). Returns per rank ``{"sent", "received", "sent_by_level",
    "received_by_level"}``.
    """
    W = len(ids)
    assert W == world
    out = [{"sent": 0, "received": 0, "sent_by_level": [0] * lay.depth, "received_by_level": [0] * lay.depth}
           for _ in range(W)]

    def add(r: int, level: int, sent: int, recv: int) -> None:
        out[r]["sent"] += sent
        out[r]["received"] += recv
        out[r]["sent_by_level"][level] += sent
        out[r]["received_by_level"][level] += recv

    n_micro = len(ids[0])
    for level in lay.active_levels:
        rb = row_bytes * lay.block_size(level)
        splits = (W - 1) * id_bytes
        for m in range(n_micro):  # fetch: ids go to the owners, rows come back
            a, b = _requests([torch.unique(ids[r][m][:, level]) for r in range(W)], W, level, owner)
            for r in range(W):
                add(r, level, splits + a[r] * id_bytes + b[r] * rb, splits + b[r] * id_bytes + a[r] * rb)
        # reduce_gradients: (id, gradient row) pairs of the step's union go to the owners
        a, b = _requests([torch.unique(torch.cat([ids[r][m][:, level] for m in range(n_micro)])) for r in range(W)], W,
                         level, owner)
        gb = grad_bytes * lay.block_size(level)
        for r in range(W):
            add(r, level, splits + a[r] * (id_bytes + gb), splits + b[r] * (id_bytes + gb))
    return out


def _requests(uniq: list[torch.Tensor], W: int, level: int = 0, owner=None) -> tuple[list[int], list[int]]:
    """a[r]: rank r's unique ids owned by other ranks; b[r]: other ranks' unique ids owned by r."""
    a, b = [0] * W, [0] * W
    for q in range(W):
        owners = uniq[q] % W if owner is None else owner(level, uniq[q])
        counts = torch.bincount(owners, minlength=W).tolist()
        a[q] = sum(counts) - counts[q]
        for r in range(W):
            if r != q:
                b[r] += counts[r]
    return a, b


def affine_owner(world: int):
    """ShardedMemoryBank's cluster-affine owner map for ``world`` ranks in K groups of world / K (one
    level-1 subtree per group, as memtrain.data.loader.affine_groups forms them for equal subtrees):
    row g of level l belongs to rank ``per_group * (g // K^l) + g % per_group``."""
    per_group = world // K

    def owner(level: int, rows: torch.Tensor) -> torch.Tensor:
        return per_group * (rows // K ** level) + rows % per_group

    return owner


def affine_ids(rank: int, world: int, B: int, depth: int, gen: torch.Generator) -> torch.Tensor:
    """Rank ``rank``'s ids under affine placement: its group's level-1 subtree, leaves uniform within it."""
    subtree = rank // (world // K)
    leaf = subtree * K ** (depth - 1) + torch.randint(0, K ** (depth - 1), (B,), generator=gen)
    return torch.stack([leaf // K ** (depth - 1 - l) for l in range(depth)], 1)


def zero3_bytes(bank_params: int, world: int, micro_batches: int, row_bytes: int) -> int:
    """Per-rank bytes of ZeRO-3 for the bank as a dense parameter (as zero3_reference_bytes): two
    all-gathers in the storage dtype (``row_bytes``) and a reduce-scatter of the fp32 gradient per
    micro-batch, each (W - 1) / W of the bank."""
    return micro_batches * (world - 1) * bank_params * (2 * row_bytes + 4) // world


# --------------------------------------------------------------------------------------------------
# Measured runs (worker processes)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, out_dir: str, body, spec: dict) -> None:
    """One gloo process (one thread): ``body(rank, spec)``'s result saved as ``rank{rank}.pt``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    from memtrain.parallel.dist import import_group_capturers
    import_group_capturers()  # before the group starts, so that destroy_process_group frees it
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.save(body(rank, spec), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def spawn_ranks(body, world: int, spec: dict) -> tuple[list[dict], float]:
    """Run ``body(rank, spec)`` (a module-level function) on ``world`` gloo processes on this machine;
    returns every rank's result and the wall time of the whole spawn."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        mp.spawn(_rank_main, args=(world, _free_port(), tmp, body, spec), nprocs=world, join=True)
        wall = time.perf_counter() - t0
        return [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)], wall


def _hierarchical_rank(rank: int, spec: dict) -> dict:
    """Part 1 on one rank: a few training steps of the ShardedMemoryBank, bytes and time per step."""
    import torch.distributed as dist

    from memtrain.parallel.sharded_bank import ShardedMemoryBank

    lay = build_layout(ModelConfig(**spec["model"]), spec["levels"])
    t0 = time.perf_counter()
    bank = ShardedMemoryBank(lay, seed=0, dtype=getattr(torch, spec["dtype"]))
    bank.build_optimizer(LR, (0.9, 0.95), 1e-8, 0.1)
    init_s = time.perf_counter() - t0
    steps = []
    for step in range(spec["steps"]):
        dist.barrier()
        t0 = time.perf_counter()
        for micro in range(spec["accum"]):
            mem = bank.fetch(micro_ids(step, rank, micro, spec["B"], lay.depth))
            loss = sum(r.square().sum() for r in mem.levels if r is not None)
            loss.backward()
        bank.reduce_gradients()
        bank.step(LR)
        secs = time.perf_counter() - t0
        steps.append({"secs": secs, **bank.comm_bytes(), "zero3": bank.zero3_reference_bytes()})
    return {"steps": steps, "init_s": init_s}


def measure(name: str, levels, world: int, quick: bool, B: int, accum: int, steps: int,
            dtype: str = "float32") -> dict:
    model_cfg = scaled_anchor(name, quick)
    lay = build_layout(model_cfg, levels)
    spec = {"model": {k: getattr(model_cfg, k) for k in ("d_model", "n_layers", "n_heads", "head_dim", "ffn_dim")},
            "levels": list(levels), "B": B, "accum": accum, "steps": steps, "dtype": dtype}
    row_bytes = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    res, wall = spawn_ranks(_hierarchical_rank, world, spec)

    # The byte model on the same ids, step by step, rank by rank.
    mismatches = []
    for step in range(steps):
        ids = [[micro_ids(step, r, m, B, lay.depth) for m in range(accum)] for r in range(world)]
        pred = predict_bytes(lay, world, ids, row_bytes=row_bytes)
        for r in range(world):
            got = res[r]["steps"][step]
            if (got["sent"], got["received"]) != (pred[r]["sent"], pred[r]["received"]):
                mismatches.append({"step": step, "rank": r, "measured": [got["sent"], got["received"]],
                                   "model": [pred[r]["sent"], pred[r]["received"]]})
    timed = range(1, steps) if steps > 1 else range(steps)  # step 0: warm-up
    sent = [res[r]["steps"][s]["sent"] for r in range(world) for s in range(steps)]
    recv = [res[r]["steps"][s]["received"] for r in range(world) for s in range(steps)]
    zero3 = res[0]["steps"][0]["zero3"]
    assert zero3 == zero3_bytes(lay.bank_parameters, world, accum, row_bytes)
    step_secs = [max(res[r]["steps"][s]["secs"] for r in range(world)) for s in timed]  # slowest rank
    mean_sent = statistics.fmean(sent)
    return {
        "kind": "measured", "config": f"{name} levels {tuple(levels)}", "anchor": name, "levels": list(levels),
        "branching": K, "depth": len(levels), "scaled": True, **layout_info(lay),
        "world": world, "backend": "gloo", "device": "cpu", "threads_per_rank": 1, "bank_dtype": dtype,
        "micro_batch": B, "micro_batches_per_step": accum, "steps": steps, "timed_steps": len(step_secs),
        "bank_bytes_sent_per_rank_step_mean": round(mean_sent, 1),
        "bank_bytes_sent_per_rank_step_max": max(sent),
        "bank_bytes_received_per_rank_step_mean": round(statistics.fmean(recv), 1),
        "zero3_bytes_per_rank_step": zero3,
        "ratio_vs_zero3": round(zero3 / mean_sent, 3),
        "ratio_vs_zero3_busiest_rank": round(zero3 / max(sent), 3),
        "step_s_median": round(statistics.median(step_secs), 5),
        "step_s_max": round(max(step_secs), 5),
        "bank_init_s_max": round(max(r["init_s"] for r in res), 3),
        "spawn_wall_s": round(wall, 2),
        "model_matches_measured": not mismatches, "model_mismatches": mismatches[:4],
        "what": "measured: bytes from ShardedMemoryBank.comm_bytes() on every rank and step, time per step "
                "(fetch+backward+reduce_gradients+step, slowest rank, median over the steps after a warm-up) "
                "on CPU gloo processes sharing the machine's cores; ZeRO-3 bytes from zero3_reference_bytes()",
    }


# --------------------------------------------------------------------------------------------------
# The 64-rank figure (derived)


def derive_64(name: str, levels, draws: int, measured_ok: bool | None, assignments: dict | None = None) -> dict:
    lay = build_layout(ANCHORS[name], levels)
    W = RANKS_64
    B = GLOBAL_BATCH_SEQS // W  # 16 sequences per rank per step, one micro-batch
    m = 1
    mean_sent, max_sent, by_level, bf16_mean = [], [], [0.0] * lay.depth, []
    for d in range(draws):
        ids = [[micro_ids(0, r, 0, B, lay.depth, seed=1 + d)] for r in range(W)]
        pred = predict_bytes(lay, W, ids)
        pred16 = predict_bytes(lay, W, ids, row_bytes=2)  # bf16 rows, fp32 gradients (memory.bank_dtype bf16)
        sent = [p["sent"] for p in pred]
        assert sum(sent) == sum(p["received"] for p in pred)  # every off-rank byte sent is received
        mean_sent.append(statistics.fmean(sent))
        max_sent.append(max(sent))
        bf16_mean.append(statistics.fmean(p["sent"] for p in pred16))
        for l in range(lay.depth):
            by_level[l] += sum(p["sent_by_level"][l] for p in pred) / (W * draws)
    # Cluster-affine placement (data.placement affine + the affine owner map): 16 groups of 4 ranks.
    affine_mean = []
    for d in range(draws):
        gens = [torch.Generator().manual_seed(7919 * (1 + d) + r) for r in range(W)]
        ids = [[affine_ids(r, W, B, lay.depth, gens[r])] for r in range(W)]
        affine_mean.append(statistics.fmean(p["sent"] for p in predict_bytes(lay, W, ids, owner=affine_owner(W))))
    bank_affine = statistics.fmean(affine_mean)
    bank = statistics.fmean(mean_sent)
    bank_bf16 = statistics.fmean(bf16_mean)
    busiest = statistics.fmean(max_sent)
    z32 = zero3_bytes(lay.bank_parameters, W, m, 4)
    z16 = zero3_bytes(lay.bank_parameters, W, m, 2)
    # The same with leaf ids drawn from each cluster assignment of the synthetic corpus.
    by_assignment: dict = {}
    for kind in ("greedy", "balanced") if assignments else ():
        a = assignments[kind]
        a_mean, a_max = [], []
        for d in range(draws):
            ids = [[leaf_draw(a["probs"], B, lay.depth, torch.Generator().manual_seed(104_729 * (1 + d) + r))]
                   for r in range(W)]
            sent = [p["sent"] for p in predict_bytes(lay, W, ids)]
            a_mean.append(statistics.fmean(sent))
            a_max.append(max(sent))
        z = zero3_bytes(lay.bank_parameters, W, m, 4)
        by_assignment[kind] = {
            "max_share_of_parent": a["max_share_of_parent"],
            "ratio_vs_zero3": round(z / statistics.fmean(a_mean), 3),
            "ratio_vs_zero3_busiest_rank": round(z / statistics.fmean(a_max), 3),
            **{key: a[key] for key in ("affine_64_busiest_rank_share_over_ideal", "documents_moved_from_greedy")
               if key in a},
        }
    # Worst case: every rank's B sequences in min(B, k^l) distinct clusters per level, none on the rank
    # itself (mean over ranks of bytes sent = received = this).
    worst = sum(2 * (W - 1) * ID_BYTES + min(B, lay.rows(l)) * (2 * ID_BYTES + 2 * 4 * lay.block_size(l))
                for l in lay.active_levels)
    return {
        "kind": "derived_64_ranks", "config": f"{name} levels {tuple(levels)}", "anchor": name,
        "levels": list(levels), "branching": K, "depth": len(levels), "scaled": False, **layout_info(lay),
        "world": W, "global_batch_seqs": GLOBAL_BATCH_SEQS, "seq_len": SEQ_LEN, "seqs_per_rank_step": B,
        "micro_batches_per_step": m, "leaf_distribution": "uniform over 16^4 leaves",
        "cluster_size_distribution": "uniform here (no real cluster-size distribution in this repo); "
                                     "cluster_assignment: a synthetic corpus's greedy and balanced assignments",
        "draws": draws,
        "bank_bytes_per_rank_step_mean": round(bank, 1),
        "bank_bytes_per_rank_step_busiest_rank": round(busiest, 1),
        "bank_bytes_per_rank_step_worst_case": worst,
        "bank_bytes_share_by_level": [round(b / bank, 4) for b in by_level],
        "zero3_bytes_per_rank_step_fp32": z32, "zero3_bytes_per_rank_step_bf16": z16,
        "ratio_vs_zero3": round(z32 / bank, 3),
        "ratio_vs_zero3_headline_dtype": "fp32 ZeRO-3 vs the bank's fp32 rows and gradients (as counted)",
        "bank_bytes_per_rank_step_bf16_rows": round(bank_bf16, 1),
        "ratio_vs_zero3_bf16_rows": round(z16 / bank_bf16, 3),
        "bf16_rows": "memory.bank_dtype bf16: rows fetched in bf16, gradients in fp32; ZeRO-3 of the same bf16 bank "
                     "(bf16 all-gathers, fp32 gradient reduce-scatter)",
        "ratio_vs_zero3_busiest_rank": round(z32 / busiest, 3),
        "ratio_vs_zero3_worst_case": round(z32 / worst, 3),
        "bank_bytes_per_rank_step_affine": round(bank_affine, 1),
        "ratio_vs_zero3_affine": round(z32 / bank_affine, 3),
        "affine": "data.placement affine + ShardedMemoryBank(subtree_ranks=...): 16 groups of 4 ranks, a rank's "
                  "sequences from its group's level-1 subtree (leaves uniform within it), rows owned within the "
                  "group; same byte model with the affine owner map (the map itself is exercised end to end in "
                  "tests/test_hmem_train.py, where only split sizes cross ranks)",
        **({"ratio_vs_zero3_busiest_rank_greedy": by_assignment["greedy"]["ratio_vs_zero3_busiest_rank"],
            "ratio_vs_zero3_busiest_rank_balanced": by_assignment["balanced"]["ratio_vs_zero3_busiest_rank"],
            "cluster_assignment": {
                **{key: v for key, v in assignments.items() if key not in ("greedy", "balanced")},
                "corpus": "synthetic_corpus(): 32 Zipf-sized domains x 16 Zipf-sized topics, dim 32, noise 0.3",
                "sequences": "drawn in proportion to each leaf's documents, global placement, round-robin owners",
                **by_assignment}} if by_assignment else {}),
        "byte_model_validated_by_measurement": measured_ok,
        "what": "derived: bank bytes from predict_bytes (validated exactly against comm_bytes() in the measured "
                "runs) on the full-size layout with 64 ranks and seeded uniform ids (cluster_assignment: ids drawn "
                "from a synthetic corpus's greedy and balanced assignments), mean over draws and ranks; ZeRO-3 "
                "bytes from 3 m (W-1)/W P b; nothing here is measured",
    }


# --------------------------------------------------------------------------------------------------
# Part 5: the sharded cross-attention bank (memtrain.parallel.chapter_bank)

CB_TOKENS, CB_CHAPTERS = 1_000_000, 1000  # the proposal's shared bank: 1M latent tokens, 1,000 chapters of 1,000
CB_LAYERS = 4  # memory layers reading the one shared bank: one fetch each per forward
CB_TOP_K, CB_TOP_K_SMALL = 16, 4  # measured routing (chapters per sequence), and the comparison run's
CB_DERIVED_WIDTHS, CB_DERIVED_TOP_K = (1024, 2048), (10, 20)


def chapter_ids(step: int, rank: int, micro: int, layer: int, B: int, chapters: int, top_k: int,
                seed: int = 0) -> torch.Tensor:
    """``[B, top_k]`` sequence-level routing of one memory layer: each of the B sequences picks
    ``top_k`` distinct chapters uniformly, seeded by step, rank, micro-batch and layer."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + 100_003 * step + 1_009 * rank + 101 * micro + layer)
    return torch.multinomial(torch.ones(B, chapters), top_k, replacement=False, generator=g)


def chapter_fetches(step: int, rank: int, run: dict, seed: int = 0) -> list[tuple[int, torch.Tensor]]:
    """Rank ``rank``'s fetches of one step in call order, as ``predict_chapter_bytes`` takes them: per
    micro-batch, per memory layer, (bank 0, the sorted unique chapters of the layer's routing), which
    is what ``sequence_routed_attention`` passes to ``bank.chapters``."""
    return [(0, torch.unique(chapter_ids(step, rank, micro, layer, run["B"], run["chapters"], run["top_k"], seed)))
            for micro in range(run["accum"]) for layer in range(run["layers"])]


def _chapter_rank(rank: int, spec: dict) -> dict:
    """Part 5 on one rank: for each run of ``spec["runs"]``, a ShardedChapterBank trained a few steps
    through its view (``ChapterBankView.chapters``, the model's path), bytes and time per step."""
    import torch.distributed as dist

    from memtrain.parallel.chapter_bank import ShardedChapterBank

    out = []
    for run in spec["runs"]:
        t0 = time.perf_counter()
        bank = ShardedChapterBank(1, run["tokens"], run["width"], run["chapters"], dtype=getattr(torch, run["dtype"]),
                                  seed=0, reads_per_forward=run["layers"])
        bank.build_optimizer(LR, (0.9, 0.95), 1e-8, 0.1)
        init_s = time.perf_counter() - t0
        view = bank.views[0]  # training mode: its fetches are counted
        steps = []
        for step in range(run["steps"]):
            fetches = chapter_fetches(step, rank, run)
            dist.barrier()
            t0 = time.perf_counter()
            for micro in range(run["accum"]):
                reads = fetches[micro * run["layers"]:(micro + 1) * run["layers"]]
                loss = sum(view.chapters(ids).square().sum() for _, ids in reads)  # one forward: every layer reads
                loss.backward()
            bank.reduce_gradients()
            bank.step(LR)
            secs = time.perf_counter() - t0
            frac = bank.stats(norms=False)["memory_module/bank_chapters_fetched_frac"]  # collective, untimed
            steps.append({"secs": secs, **bank.comm_bytes(), "zero3": bank.zero3_reference_bytes(),
                          "fetched_frac": frac})
        out.append({"steps": steps, "init_s": init_s})
        del bank, view
    return {"runs": out}


def expected_chapter_bytes(world: int, chapters: int, chapter_tokens: int, width: int, top_k: int, B: int,
                           layers: int, accum: int = 1, row_bytes: int = 4, grad_bytes: int = 4) -> dict:
    """Expected bytes one rank sends per step (= receives; mean over ranks) under uniform sequence-level
    routing: :func:`predict_chapter_bytes`'s formula with the counts replaced by expectations. With
    R = chapter_tokens * width numbers a chapter, m = ``accum`` micro-batches, L = ``layers`` fetches
    per forward, U_f = ``expected_unique(C, k, B)`` (a rank's distinct chapters per fetch) and
    U_s = ``expected_unique(C, k, B L m)`` (its union over the step, what ``reduce_gradients`` sends),
    a fraction (W - 1) / W of them owned by other ranks (round robin)::

        m L [(W-1) 8 + (W-1)/W U_f (8 + R e)]  +  (W-1) 8 + (W-1)/W U_s (8 + R 4)

    (split sizes; ids out and chapters back per fetch, e = storage bytes; (id, fp32 gradient row)
    pairs per bank per step). The rank's own chapters (1/W) move nothing."""
    off = (world - 1) / world
    splits = (world - 1) * ID_BYTES
    R = chapter_tokens * width
    u_fetch = expected_unique(chapters, top_k, B)
    u_step = expected_unique(chapters, top_k, B * layers * accum)
    fetch = accum * layers * (splits + off * u_fetch * (ID_BYTES + R * row_bytes))
    grads = splits + off * u_step * (ID_BYTES + R * grad_bytes)
    return {"bytes": fetch + grads, "fetch_bytes": fetch, "gradient_bytes": grads,
            "unique_per_fetch": u_fetch, "unique_per_step": u_step}


def measure_chapter_bank(world: int, runs: list[dict], env: dict) -> list[dict]:
    """The runs (one spawn of ``world`` gloo processes) checked against :func:`predict_chapter_bytes`,
    one ``"chapter_bank"`` line each."""
    res, wall = spawn_ranks(_chapter_rank, world, {"runs": runs})
    lines = []
    for i, run in enumerate(runs):
        got = [res[r]["runs"][i] for r in range(world)]
        steps, C = run["steps"], run["chapters"]
        chapter_tokens = run["tokens"] // C
        row_bytes = torch.empty((), dtype=getattr(torch, run["dtype"])).element_size()
        mismatches, share_fetch, share_step, share_all = [], [], [], []
        share_matches_stats = True
        for step in range(steps):
            fetches = [chapter_fetches(step, r, run) for r in range(world)]
            pred = predict_chapter_bytes(1, chapter_tokens * run["width"], fetches, row_bytes=row_bytes)
            for r in range(world):
                g = got[r]["steps"][step]
                if (g["sent"], g["received"]) != (pred[r]["sent"], pred[r]["received"]):
                    mismatches.append({"step": step, "rank": r, "measured": [g["sent"], g["received"]],
                                       "model": [pred[r]["sent"], pred[r]["received"]]})
            unions = [torch.unique(torch.cat([ids for _, ids in f])) for f in fetches]
            share_fetch += [len(ids) / C for f in fetches for _, ids in f]
            share_step += [len(u) / C for u in unions]
            share_all.append(len(torch.unique(torch.cat(unions))) / C)
            share_matches_stats &= abs(got[0]["steps"][step]["fetched_frac"] - share_all[-1]) < 1e-12
        P = run["tokens"] * run["width"]
        zero3 = got[0]["steps"][0]["zero3"]
        assert zero3 == zero3_chapter_bytes(P, world, run["accum"], row_bytes)
        sent = [got[r]["steps"][s]["sent"] for r in range(world) for s in range(steps)]
        recv = [got[r]["steps"][s]["received"] for r in range(world) for s in range(steps)]
        timed = range(1, steps) if steps > 1 else range(steps)  # step 0: warm-up
        step_secs = [max(got[r]["steps"][s]["secs"] for r in range(world)) for s in timed]  # slowest rank
        mean_sent = statistics.fmean(sent)
        expected = expected_chapter_bytes(world, C, chapter_tokens, run["width"], run["top_k"], run["B"],
                                          run["layers"], run["accum"], row_bytes)
        lines.append({
            "kind": "chapter_bank", "part": "measured", "bank": "ShardedChapterBank (one shared bank)",
            "tokens": run["tokens"], "chapters": C, "chapter_tokens": chapter_tokens,
            "width": run["width"], "width_scaled": True, "bank_params": P, "bank_dtype": run["dtype"],
            "memory_layers": run["layers"], "fetches_per_forward": run["layers"], "routing": "sequence",
            "top_k": run["top_k"], "seqs_per_rank_micro_batch": run["B"], "micro_batches_per_step": run["accum"],
            "ids": "uniform, distinct per sequence, seeded by step, rank, micro-batch and layer",
            "world": world, "backend": "gloo", "device": "cpu", "threads_per_rank": 1,
            "steps": steps, "timed_steps": len(step_secs),
            "bank_bytes_sent_per_rank_step_mean": round(mean_sent, 1),
            "bank_bytes_sent_per_rank_step_max": max(sent),
            "bank_bytes_received_per_rank_step_mean": round(statistics.fmean(recv), 1),
            "expected_bytes_per_rank_step_uniform": round(expected["bytes"], 1),
            "zero3_reference_bytes": zero3,
            "ratio_vs_zero3": round(zero3 / mean_sent, 3),
            "ratio_vs_zero3_busiest_rank": round(zero3 / max(sent), 3),
            "routed_share_per_rank_fetch": round(statistics.fmean(share_fetch), 4),
            "routed_share_per_rank_step": round(statistics.fmean(share_step), 4),
            "routed_share_all_ranks_step": round(statistics.fmean(share_all), 4),
            "routed_share_matches_stats": share_matches_stats,
            "step_s_median": round(statistics.median(step_secs), 5),
            "step_s_max": round(max(step_secs), 5),
            "bank_init_s_max": round(max(g["init_s"] for g in got), 3),
            "spawn_wall_s": round(wall, 2),
            "model_matches_measured": not mismatches, "model_mismatches": mismatches[:4],
            "what": "measured: per step each rank draws its routing, then fetch (ChapterBankView.chapters of each "
                    "layer's unique chapters, one fetch per memory layer) -> loss = sum of squares -> backward -> "
                    "reduce_gradients() -> step(lr); bytes from comm_bytes() on every rank and step, checked "
                    "exactly against predict_chapter_bytes on every rank's ids; ZeRO-3 bytes from "
                    "zero3_reference_bytes() (= zero3_chapter_bytes: gathered once per micro-batch, a lower bound "
                    "for a bank read by several layers); routed shares = distinct chapters / C (per rank per fetch, "
                    "per rank over the step, all ranks over the step = stats()' bank_chapters_fetched_frac); time "
                    "per step = fetch+backward+reduce_gradients+step, slowest rank, median after a warm-up step, "
                    "gloo processes sharing this machine's cores",
            **env,
        })
    return lines


def traffic_vs_routing(small: dict, large: dict) -> dict:
    """The same bank and world at top-k 4 and 16: bytes follow the routed chapters, ZeRO-3's do not move."""
    b_small, b_large = small["bank_bytes_sent_per_rank_step_mean"], large["bank_bytes_sent_per_rank_step_mean"]
    return {
        "kind": "chapter_bank", "part": "traffic_vs_routing", "world": large["world"], "tokens": large["tokens"],
        "chapters": large["chapters"], "width": large["width"], "memory_layers": large["memory_layers"],
        "top_k": [small["top_k"], large["top_k"]],
        f"bytes_ratio_top{large['top_k']}_vs_top{small['top_k']}": round(b_large / b_small, 3),
        "expected_bytes_ratio_uniform": round(large["expected_bytes_per_rank_step_uniform"]
                                              / small["expected_bytes_per_rank_step_uniform"], 3),
        "routed_chapters_ratio_per_fetch": round(large["routed_share_per_rank_fetch"]
                                                 / small["routed_share_per_rank_fetch"], 3),
        "routed_chapters_ratio_per_step": round(large["routed_share_per_rank_step"]
                                                / small["routed_share_per_rank_step"], 3),
        "zero3_ratio": round(large["zero3_reference_bytes"] / small["zero3_reference_bytes"], 3),
        "ratio_vs_zero3": [small["ratio_vs_zero3"], large["ratio_vs_zero3"]],
        "what": "the measured lines of the two runs: the bank's bytes grow with the distinct chapters a rank routes "
                "to (4x the picks, fewer than 4x distinct chapters: overlaps), fetches with those per fetch and "
                "gradients with those of the step (hence a bytes ratio between the two chapter ratios, as "
                "expected_chapter_bytes predicts); the bank and ZeRO-3's bytes stay the same",
    }


def derive_chapter_64(width: int, top_k: int, draws: int, measured_ok: bool | None, B: int, layers: int = CB_LAYERS,
                      accum: int = 1) -> dict:
    """Part 5 at 64 ranks with the full-width bank: expected bytes (:func:`expected_chapter_bytes`) against
    ZeRO-3, and the byte model's mean over ``draws`` seeded uniform draws as a check of the expectation."""
    W, C = RANKS_64, CB_CHAPTERS
    chapter_tokens = CB_TOKENS // C
    P = CB_TOKENS * width
    exp = expected_chapter_bytes(W, C, chapter_tokens, width, top_k, B, layers, accum)
    one_layer = expected_chapter_bytes(W, C, chapter_tokens, width, top_k, B, 1, accum)
    bf16 = expected_chapter_bytes(W, C, chapter_tokens, width, top_k, B, layers, accum, row_bytes=2)
    run = {"B": B, "chapters": C, "top_k": top_k, "accum": accum, "layers": layers}
    drawn = [statistics.fmean(p["sent"] for p in predict_chapter_bytes(
        1, chapter_tokens * width, [chapter_fetches(0, r, run, seed=1 + d) for r in range(W)])) for d in range(draws)]
    z32 = zero3_chapter_bytes(P, W, accum, 4)
    z16 = zero3_chapter_bytes(P, W, accum, 2)
    return {
        "kind": "chapter_bank", "part": "derived_64_ranks", "world": W, "tokens": CB_TOKENS, "chapters": C,
        "chapter_tokens": chapter_tokens, "width": width, "width_scaled": False, "bank_params": P,
        "memory_layers": layers, "routing": "sequence", "top_k": top_k, "seqs_per_rank_micro_batch": B,
        "micro_batches_per_step": accum,
        "expected_unique_chapters_per_rank_fetch": round(exp["unique_per_fetch"], 2),
        "expected_unique_chapters_per_rank_step": round(exp["unique_per_step"], 2),
        "bank_bytes_per_rank_step": round(exp["bytes"]),
        "bank_fetch_bytes_per_rank_step": round(exp["fetch_bytes"]),
        "bank_gradient_bytes_per_rank_step": round(exp["gradient_bytes"]),
        "byte_model_mean_over_draws": round(statistics.fmean(drawn)), "draws": draws,
        "zero3_bytes_per_rank_step": z32,
        "ratio_vs_zero3": round(z32 / exp["bytes"], 3),
        "ratio_vs_zero3_one_memory_layer": round(z32 / one_layer["bytes"], 3),
        "ratio_vs_zero3_bf16_rows": round(z16 / bf16["bytes"], 3),
        "formula": "per rank per step, mean over ranks (sent = received): m L [(W-1) 8 + (W-1)/W U_f (8 + R e)] + "
                   "(W-1) 8 + (W-1)/W U_s (8 + 4 R); R = chapter_tokens x width, e = 4 (fp32 rows; 2 for "
                   "ratio_vs_zero3_bf16_rows), U_f = expected_unique(C, k, B), U_s = expected_unique(C, k, B L m); "
                   "ZeRO-3: m (W-1)/W P (2 e + 4), P = tokens x width",
        "byte_model_validated_by_measurement": measured_ok,
        "note": "derived, not measured: uniform routing is assumed (every sequence's k distinct chapters uniform over "
                "C, independently per layer and rank); a trained router that concentrates on few chapters moves "
                "less, correlated picks across ranks leave per-rank bytes unchanged but load the owners of popular "
                "chapters more (busiest rank not modelled here). ZeRO-3 is its lower bound (the shared bank "
                "gathered once per micro-batch, not once per reading layer); with L layers reading, the sharded "
                "bank fetches L times, hence ratio_vs_zero3 < ratio_vs_zero3_one_memory_layer",
    }


def chapter_bank_part(worlds: list[int], quick: bool, B: int, accum: int, steps: int, draws: int, env: dict,
                      emit) -> bool | None:
    """Part 5: the measured runs (exit on a byte-model mismatch), traffic vs routing, the 64-rank figures."""
    base = {"tokens": CB_TOKENS, "chapters": CB_CHAPTERS, "width": 8 if quick else 16, "layers": CB_LAYERS,
            "top_k": CB_TOP_K, "B": B, "accum": accum, "steps": steps, "dtype": "float32"}
    ok = True if worlds else None
    for world in worlds:
        runs = [base] + ([{**base, "top_k": CB_TOP_K_SMALL}] if world == worlds[0] else [])
        lines = measure_chapter_bank(world, runs, env)
        for rec in lines:
            emit(rec)
            ok = ok and rec["model_matches_measured"] and rec["routed_share_matches_stats"]
            if not rec["model_matches_measured"]:
                raise SystemExit(f"chapter-bank byte model differs from the measured bytes: {rec['model_mismatches']}")
            if not rec["routed_share_matches_stats"]:
                raise SystemExit("routed chapters differ from the bank's stats()")
        if len(lines) == 2:
            emit({**traffic_vs_routing(lines[1], lines[0]), **env})
    for width in CB_DERIVED_WIDTHS:
        for top_k in CB_DERIVED_TOP_K:
            emit({**derive_chapter_64(width, top_k, draws, ok, B), **env})
    return ok


# --------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small scaled layouts for a CPU run in a minute or two")
    ap.add_argument("--world", default="2,4", help="comma-separated numbers of gloo processes")
    ap.add_argument("--steps", type=int, default=None, help="steps per measured run (first is a warm-up)")
    ap.add_argument("--micro-batch", type=int, default=GLOBAL_BATCH_SEQS // RANKS_64,
                    help="sequences per rank per micro-batch (default 16: the paper's batch on 64 ranks)")
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per step")
    ap.add_argument("--draws", type=int, default=None, help="seeded id draws for the 64-rank figure")
    ap.add_argument("--out", default=None, help="also write the JSON lines to this file")
    ap.add_argument("--corpus", type=int, default=None,
                    help="documents of the synthetic corpus whose cluster assignments the ids are drawn from "
                         "(default 65536 with --quick, else 262144; 0 skips)")
    ap.add_argument("--only", choices=("hierarchical", "chapter_bank"), default=None,
                    help="run only parts 1-4 (the hierarchical ShardedMemoryBank) or only part 5 (the sharded "
                         "cross-attention bank); default both")
    args = ap.parse_args()
    steps = args.steps or (3 if args.quick else 6)
    draws = args.draws or (8 if args.quick else 32)
    worlds = [int(w) for w in args.world.split(",") if w]
    out = open(args.out, "w") if args.out else None
    t_start = time.perf_counter()

    def emit(rec: dict) -> None:
        line = json.dumps(rec)
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    env = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
           "quick": args.quick}
    if args.only in (None, "hierarchical"):
        ok_all = True if worlds else None
        for name, levels in CONFIGS:
            for world in worlds:
                for dtype in ("float32", "bfloat16") if world == worlds[0] else ("float32",):
                    rec = measure(name, levels, world, args.quick, args.micro_batch, args.accum, steps, dtype)
                    ok_all = ok_all and rec["model_matches_measured"]
                    emit({**rec, **env})
                    if not rec["model_matches_measured"]:
                        raise SystemExit(f"byte model differs from the measured bytes: {rec['model_mismatches']}")
        n_corpus = args.corpus if args.corpus is not None else (65536 if args.quick else 262144)
        assignments = None
        if n_corpus:
            assignments = cluster_assignments(n_corpus, steps=5 if args.quick else 20,
                                              samples=512 if args.quick else 6400)
        for name, levels in CONFIGS:
            emit({**derive_64(name, levels, draws, ok_all, assignments), **env})
    if args.only in (None, "chapter_bank"):
        chapter_bank_part(worlds, args.quick, args.micro_batch, args.accum, steps, draws, env, emit)
    emit({"kind": "summary", "total_s": round(time.perf_counter() - t_start, 1), **env})
    if out:
        out.close()


if __name__ == "__main__":
    main()
