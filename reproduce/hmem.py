"""Reproduce the hierarchical-memories paper's headline effect at small scale (``make reproduce-hmem``).

Pouransari et al., "Pretraining with hierarchical memories" (../shared/papers/hierarchical-memories.md):
Sections 3-5, Table 1 (rows A1 anchor, A2 memories added to the trained anchor and co-trained, A4
co-trained from scratch), Fig. 4a / Table 9 (bank size at a fixed fetched size), Fig. 6b (blocking
the best-matching part of the bank) and Appendix J (wrong cluster ids).

The set-up keeps the points that carry the paper's effect, scaled to the built-in long-tail corpus
(``builtin:longtail``: ~500 entities at Zipf frequencies, ~1.9k documents, probes in head / torso /
tail buckets) and a 2-core CPU (``recipes/reproduce-hmem.yaml``):

- a deep, wide tree (k = 8, p = 3: 512 leaves, a few entities per leaf; the paper: 16^4);
- a bank many times the anchor (memory.levels (16, 16, 48): 39.5M parameters, 33x the 1.18M anchor)
  with about a tenth of the anchor fetched per sequence (123k; the paper's A2: 18M of 4.6B, 28x);
- an anchor too small to store every fact, and every fact seen several times (the corpus is read
  for ~5 epochs in stage 1 and ~3 more in stage 2).

Arms (every arm reads the same data in the same order with the same seed, batch and schedule; the
memory arms add the memory optimizer of the quickstart recipe, untuned here):

========================  =====================================================================
``anchor``                A1: the anchor alone, S1 steps from scratch
``anchor-continued``      the A1 anchor continued alone for S2 steps (A2's baseline: same tokens)
``a2-32x``                A2: memories (33x bank) added to the A1 anchor, co-trained S2 steps
``a2-1x/4x/16x``          A2 with a 1x, 4x, 16x bank at the same fetched size (Fig. 4a sweep)
``anchor-scratch``        the anchor alone for S1 + S2 steps from scratch (A4's baseline)
``a4-32x``                A4: anchor + memories (33x bank) from scratch, S1 + S2 steps
``iso-params``            an anchor with as many parameters as anchor + fetched memory (its FFN
                          wider by the fetched units), S1 + S2 steps from scratch (the paper's
                          comparison with a regular model of the same runtime parameters)
========================  =====================================================================

Every run is ``memtrain train`` and ``memtrain eval`` on ``recipes/reproduce-hmem.yaml`` with
overrides (printed in ``hmem.md`` and the log), so any arm can be re-run by hand. Results:
``<out>/hmem.json``, ``<out>/hmem.md`` (with the paper's numbers beside), ``<out>/hmem.png``
(probe accuracy by frequency bucket) and ``<out>/hmem.log`` (every command's output). After the arms,
:func:`retrieval_analysis` measures whether retrieval from the prompt reaches the clusters that hold
each probe's facts, and what the memory models score when it does (oracle retrieval). Running the
script again skips the arms already trained and evaluated under ``--out``.
Usage: ``python reproduce/hmem.py [--out DIR] [--gpu] [--smoke] [--arms a,b] [--data-dir DIR]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (ROOT, ReproError, argv_overrides, markdown_table, memtrain, newest_eval, pct,  # noqa: E402
                    run_script, save_plot, write_results)

RECIPE = "recipes/reproduce-hmem.yaml"
BUCKETS = ("head", "torso", "tail")
NO_MEMORY = {"memory.type": "none", "memory.levels": []}
# Stage 2 (A2 and its baseline) continues a trained anchor: a short warm-up and a lower peak, as the
# README's earlier A2 comparison did; every stage-2 arm uses the same values.
STAGE2 = {"train.schedule.warmup": "10 steps", "train.optimizer.lr": 1e-3, "train.schedule.min_lr": 1e-4}
MAIN_LEVELS = (16, 16, 48)  # 8, 64, 512 nodes: bank 25,728 units = 33x the anchor; 80 units fetched
# Fig. 4a / Table 9 style: the same 80 fetched units per sequence, the bank grown by moving units to
# deeper levels (units at level l are stored k^l times). Ratios are measured, not assumed (hmem.json).
SWEEP_LEVELS = {"1x": (78, 2, 0), "4x": (36, 44, 0), "16x": (0, 64, 16), "32x": MAIN_LEVELS}
FULL_MODES = "fetched,generic,blocked,corrupt_from_level_3,corrupt_from_level_1"
SWEEP_MODES = "fetched,generic"

# The paper's numbers shown beside ours (Table 1: Avg-SK accuracy on the specific-knowledge tasks and
# Wiki-En perplexity; Section 4 and Fig. 4a / 6b): other tasks and scale, for the direction of each effect.
PAPER = {
    "A1 anchor (160M, 1.1T tokens)": "Avg-SK 34.1%, Wiki-En ppl 17.2",
    "A2 anchor + memories (18M fetched of 4.6B), +1.1T tokens": "Avg-SK 40.3% fetched, 35.7% generic; ppl 14.2 / 16.7",
    "A4 anchor + memories from scratch, 2.2T tokens": "Avg-SK 39.6% fetched, 33.8% generic (below A2)",
    "iso-parameters: B1, a regular 410M model": "Avg-SK 40.9% (A2: 40.3% with 178M runtime parameters)",
    "blocking the best 1/16 of the bank (Fig. 6b, 410M)": "70% -> 20% on atomic numbers",
    "bank size at a fixed fetched size (Fig. 4a)": "accuracy rises with the bank",
}


@dataclass
class Scale:
    """Sizes of one reproduction: ``cpu`` (the default, ~30 minutes on 2 cores) or ``gpu`` (one GPU)."""

    s1: int  # stage-1 steps (the anchor alone from scratch)
    s2: int  # stage-2 steps (continue / add memories)
    overrides: dict[str, Any] = field(default_factory=dict)  # applied to every arm
    levels_scale: int = 1  # memory.levels of every arm times this (a wider anchor keeps fetched ~10%)


SCALES = {
    "cpu": Scale(s1=300, s2=200),
    # One GPU: the same corpus and tree, a wider anchor (d 256, 8 layers, 8.6M parameters; c0 = 6144) with
    # twice the memory units (fetched 0.98M = 11%, bank 316M = 36x), more steps and larger batches (~30
    # minutes on one H100 is a guess: not measured).
    "gpu": Scale(s1=3000, s2=2000, levels_scale=2,
                 overrides={"model.d_model": 256, "model.n_layers": 8, "model.ffn_dim": 1024,
                            "train.global_batch_tokens": 16384, "train.micro_batch_size": 64}),
    # Tests: a few steps of every arm.
    "smoke": Scale(s1=12, s2=12, overrides={"train.schedule.warmup": "2 steps", "train.eval.every_steps": 0,
                                            "checkpoint.every_steps": 12}),
}


@dataclass
class Arm:
    name: str
    label: str
    overrides: dict[str, Any]
    modes: str
    init_from: Optional[str] = None  # another arm's name: start from its newest checkpoint


def arms(scale: Scale, ffn_dim: int) -> list[Arm]:
    """Every arm of the reproduction, in the order they run (an arm's ``init_from`` runs before it)."""
    s1, s2, k = scale.s1, scale.s2, scale.levels_scale
    fetched_units = sum(MAIN_LEVELS) * k  # memory units are FFN hidden units of every layer (c0 = 3 d L)
    mem = lambda levels: {"memory.type": "ffn", "memory.levels": [r * k for r in levels]}  # noqa: E731
    out = [
        Arm("anchor", "A1: anchor alone", {**NO_MEMORY, "train.max_steps": s1}, "none"),
        Arm("anchor-continued", "anchor continued alone (A2's baseline)",
            {**NO_MEMORY, **STAGE2, "train.max_steps": s2}, "none", init_from="anchor"),
    ]
    for tag, levels in SWEEP_LEVELS.items():
        out.append(Arm(f"a2-{tag}", f"A2: anchor + memories, {tag} bank", {**mem(levels), **STAGE2, "train.max_steps": s2},
                       FULL_MODES if levels == MAIN_LEVELS else SWEEP_MODES, init_from="anchor"))
    out += [
        Arm("anchor-scratch", "anchor alone, from scratch (A4's baseline)", {**NO_MEMORY, "train.max_steps": s1 + s2},
            "none"),
        Arm("a4-32x", "A4: anchor + memories from scratch, 32x bank", {**mem(MAIN_LEVELS), "train.max_steps": s1 + s2},
            FULL_MODES),
        Arm("iso-params", "anchor with anchor + fetched parameters (iso-parameters)",
            {**NO_MEMORY, "model.ffn_dim": ffn_dim + fetched_units, "train.max_steps": s1 + s2}, "none"),
    ]
    return out


def parameter_counts(recipe_path: Path, overrides: list[str]) -> dict[str, int]:
    """Anchor, fetched and bank parameters of a recipe (built on the meta device, as `memtrain recipe show`)."""
    import torch

    from memtrain.config import load_recipe
    from memtrain.model import build, count_parameters

    recipe = load_recipe(recipe_path, overrides)
    with torch.device("meta"):
        model = build(recipe.model, recipe.memory, recipe.data.clustering.branching)
    memory = getattr(model, "memory_parameters", None)
    generic = sum(p.numel() for p in memory()) if memory is not None else 0
    layout = getattr(model, "memory_layout", None)
    return {"anchor": count_parameters(model) - generic,
            "fetched": layout.fetched_parameters if layout is not None else 0,
            "bank": layout.bank_parameters if layout is not None else 0,
            "c0": layout.c0 if layout is not None else None}


def _rates(hit, buckets) -> dict[str, Any]:
    """Share of True rows per bucket (and ``all``) of ``hit [n]``; None for an empty bucket."""
    out = {}
    for name in ("all", *BUCKETS):
        mask = buckets == name if name != "all" else buckets == buckets
        out[name] = float(hit[mask].mean()) if mask.any() else None
    return out


def retrieval_analysis(recipe_path: Path, overrides: list[str], memory_arms: dict[str, list[str]]) -> dict[str, Any]:
    """Whether retrieval from the prompt is what limits the fetched memories: two measurements.

    - **Agreement**, per level and bucket: the share of probes whose prompt, descending the prepared tree
      greedily (as `memtrain eval` retrieves it), reaches a cluster that holds a document about the
      probe's entity (documents placed by the same greedy descent; training's balanced descent moves
      some, see prepare_report.json). A block can only store a fact its cluster's documents state.
    - **Oracle retrieval**, for each arm of ``memory_arms`` (name -> its recipe overrides): probe accuracy
      when every probe fetches the path of the leaf holding most of its entity's documents instead of
      the path its prompt retrieves. Scored like `memtrain eval` (teacher-forced greedy exact match);
      the same scoring with the prompt's own ids is returned as ``fetched`` and must equal the eval report."""
    import numpy as np
    import torch

    from memtrain.config import load_recipe
    from memtrain.data import embed, longtail
    from memtrain.data.cluster import ClusterTree
    from memtrain.data.loader import data_location, read_meta
    from memtrain.data.verify import prepared_file, prepared_tokenizer
    from memtrain.eval.common import batch_memory
    from memtrain.eval.evaluate import find_checkpoint, load_model, pick_device
    from memtrain.eval.hierarchical import accuracy_table, probe_tokens, retrieve_probe_ids, score_sequences
    from memtrain.parallel import checkpoint as ckpt

    recipe = load_recipe(recipe_path, overrides)
    data_dir, remote = data_location(recipe)
    meta = read_meta(data_dir, recipe)
    cl = recipe.data.clustering
    docs = longtail.longtail_corpus(seed=0)
    tree = ClusterTree.load(prepared_file(data_dir, meta, meta["clustering"]["tree"], remote))
    doc_ids = tree.assign(embed.embed_texts([d.text for d in docs], embed.load_embedder(cl.embedding_model),
                                            cl.embedding_batch_size))
    paths: dict[str, list[tuple[int, ...]]] = {}
    for d, ids in zip(docs, doc_ids):
        paths.setdefault(d.entity, []).append(tuple(int(i) for i in ids))
    probes = longtail.probes(seed=0)
    fetched, _ = retrieve_probe_ids(recipe, data_dir, meta, [p.prompt for p in probes])
    buckets = np.array([p.bucket for p in probes])
    out: dict[str, Any] = {"agreement": {}}
    for level in range(cl.depth):
        hit = np.array([int(fetched[i, level]) in {path[level] for path in paths[p.entity]} for i, p in enumerate(probes)])
        out["agreement"][f"level{level + 1}"] = _rates(hit, buckets)
    leaves = [path[-1] for ps in paths.values() for path in ps]
    out["leaves_per_entity_mean"] = float(np.mean([len({path[-1] for path in ps}) for ps in paths.values()]))
    per_leaf = np.unique([(path[-1], e) for e, ps in paths.items() for path in ps], axis=0)[:, 0]
    out["entities_per_used_leaf_mean"] = float(np.unique(per_leaf, return_counts=True)[1].mean())
    out["used_leaves"] = int(len(set(leaves)))
    oracle = np.array([max(set(paths[p.entity]), key=paths[p.entity].count) for p in probes], np.int64)

    tokenizer = prepared_tokenizer(data_dir, meta, remote)
    seqs, starts = probe_tokens(tokenizer, [p.prompt for p in probes], [p.answer for p in probes])
    kinds = [p.kind for p in probes]
    out["arms"] = {}
    for name, arm_overrides in memory_arms.items():
        arm_recipe = load_recipe(recipe_path, arm_overrides)
        device = pick_device(arm_recipe)
        info = find_checkpoint(arm_recipe)
        with ckpt.reading(info):
            ckpt.verify(info)
            model, bank = load_model(arm_recipe, info, device)
        out["arms"][name] = {"step": info.step}
        for mode, ids in (("fetched", fetched), ("oracle", oracle)):
            ids_t = torch.from_numpy(np.ascontiguousarray(ids))
            correct = score_sequences(model, seqs, starts,
                                      lambda idx, ids_t=ids_t: batch_memory(bank, "fetched", len(idx), ids_t[idx], device),
                                      64, device, pad_id=int(tokenizer.eot_id), max_len=arm_recipe.model.max_seq_len)
            out["arms"][name][mode] = accuracy_table(correct, buckets.tolist(), kinds)
    return out


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """Per memory mode: perplexity and probe accuracy (all / per bucket, with counts) from a
    `memtrain eval` report."""
    out: dict[str, Any] = {"step": report["checkpoint"]["step"], "tokens_seen": report["checkpoint"].get("tokens_seen"),
                           "modes": {}}
    ppl = report.get("perplexity") or {}
    for mode, cells in ((report.get("probes") or {}).get("modes") or {}).items():
        out["modes"][mode] = {
            "perplexity": (ppl.get(mode) or {}).get("perplexity"),
            "all": cells["all"],
            **{b: cells["buckets"][b] for b in BUCKETS},
        }
    return out


def _cell(c: dict[str, Any]) -> str:
    return f"{pct(c.get('accuracy'))} ({c.get('correct', 0)})"


def markdown(results: dict[str, Any]) -> str:
    """The Markdown report: one row per (arm, memory mode), then the sweep and the paper's numbers."""
    rows = []
    for name, r in results["arms"].items():
        if "eval" not in r:
            continue
        p = r["params"]
        for mode, m in r["eval"]["modes"].items():
            ppl = m["perplexity"]
            rows.append([name, r["label"], mode, f"{p['anchor'] / 1e6:.2f}M", f"{p['fetched'] / 1e3:.0f}k" if p["fetched"] else "–",
                         f"{p['bank'] / 1e6:.1f}M ({p['bank'] / p['anchor']:.1f}x)" if p["bank"] else "–",
                         f"{ppl:.3f}" if ppl is not None else "–", _cell(m["all"]),
                         *(_cell(m[b]) for b in BUCKETS)])
    b = results["buckets"]
    text = [f"# Hierarchical memories at small scale ({results['scale']} sizes on {results['device']})", "",
            f"Probes: {results['probes']} (head {b['head']}, torso {b['torso']}, tail {b['tail']}); accuracy with the "
            f"number correct. Stage 1 {results['s1']} steps, stage 2 {results['s2']} steps of "
            f"{results['tokens_per_step']} tokens. Training and evaluation {results['arm_seconds'] / 60:.1f} min "
            f"(summed over the arms, as each ran), retrieval analysis {results['seconds_by_step']['retrieval']:.0f} s.",
            "",
            markdown_table(["arm", "what", "memory at eval", "anchor", "fetched", "bank", "val ppl", "all",
                            *BUCKETS], rows), ""]
    sweep = [[tag, f"{results['arms'][f'a2-{tag}']['params']['bank'] / results['arms'][f'a2-{tag}']['params']['anchor']:.1f}x",
              *(_cell(results["arms"][f"a2-{tag}"]["eval"]["modes"][m][k]) for m in ("fetched", "generic") for k in ("all", "tail"))]
             for tag in SWEEP_LEVELS if "eval" in results["arms"].get(f"a2-{tag}", {})]
    if sweep:
        text += ["Bank size at a fixed fetched size (A2, Fig. 4a):", "",
                 markdown_table(["bank", "bank / anchor", "fetched all", "fetched tail", "generic all", "generic tail"],
                                sweep), ""]
    r = results.get("retrieval")
    if r:
        agree = r["agreement"]
        text += ["Retrieval from the probe prompt (`retrieval` in the JSON): share of probes whose prompt reaches a "
                 "cluster holding a document about the probe's entity, per level "
                 f"({r['used_leaves']} leaves hold documents, {r['entities_per_used_leaf_mean']:.1f} entities per "
                 f"such leaf, {r['leaves_per_entity_mean']:.1f} leaves per entity):", "",
                 markdown_table(["probes", *(f"level {l[5:]}" for l in agree)],
                                [[b, *(pct(agree[l][b]) for l in agree)] for b in ("all", *BUCKETS)]), "",
                 "Oracle retrieval: the same models when every probe fetches the leaf holding most of its entity's "
                 "documents (the blocks trained on its fact) instead of the one its prompt retrieves:", "",
                 markdown_table(["arm", "retrieval", "all", *BUCKETS],
                                [[name, mode, _cell(a[mode]["all"]), *(_cell(a[mode]["buckets"][b]) for b in BUCKETS)]
                                 for name, a in r["arms"].items() for mode in ("fetched", "oracle")]), ""]
    text += ["The paper's corresponding numbers (160M-1.4B models, 1.1T tokens, Avg-SK tasks; direction only):", "",
             markdown_table(["paper", "result"], list(PAPER.items())), "",
             "Commands (recipe " + RECIPE + "):", ""]
    text += [f"- `{r['command']}`, then `{r['eval_command']}`" if "eval_command" in r else f"- `{r['command']}`"
             for r in results["arms"].values()]
    return "\n".join(text)


def plot(results: dict[str, Any], path: Path) -> Path:
    """Probe accuracy by frequency bucket, one line per (arm, mode) that matters."""
    lines = [("anchor-continued", "none", "anchor continued (A2 baseline)"), ("a2-32x", "fetched", "A2 fetched"),
             ("a2-32x", "generic", "A2 generic"), ("a2-32x", "blocked", "A2 blocked"),
             ("anchor-scratch", "none", "anchor from scratch"), ("a4-32x", "fetched", "A4 fetched"),
             ("iso-params", "none", "iso-parameters anchor")]
    series = {}
    for arm, mode, label in lines:
        m = results["arms"].get(arm, {}).get("eval", {}).get("modes", {}).get(mode)
        if m is not None:
            series[label] = (list(range(len(BUCKETS))), [m[b]["accuracy"] for b in BUCKETS])
    for arm, label in (("a2-32x", "A2 oracle retrieval"), ("a4-32x", "A4 oracle retrieval")):
        m = (results.get("retrieval") or {}).get("arms", {}).get(arm, {}).get("oracle")
        if m is not None:
            series[label] = (list(range(len(BUCKETS))), [m["buckets"][b]["accuracy"] for b in BUCKETS])
    return save_plot(path, series, xlabel="frequency bucket", ylabel="probe accuracy", xticks=range(len(BUCKETS)),
                     xticklabels=BUCKETS, title=f"Long-tail probes by frequency bucket ({results['scale']})",
                     ylim=(-0.02, 1.02))


def shell_command(verb: str, overrides: dict[str, Any]) -> str:
    """``memtrain VERB RECIPE key=value ...`` as a shell line (quoted; paths under the repository relative)."""
    import shlex

    def rel(v: Any) -> Any:
        return str(Path(v).relative_to(ROOT)) if isinstance(v, str) and v.startswith(str(ROOT) + "/") else v

    return " ".join(["memtrain", verb, RECIPE, *map(shlex.quote, argv_overrides({k: rel(v) for k, v in overrides.items()}))])


def finished(run_dir: Path, steps: int) -> Optional[dict[str, Any]]:
    """The arm's evaluation report when a previous invocation trained it to ``steps`` and evaluated it."""
    try:
        report = newest_eval(run_dir)
    except ReproError:
        return None
    return report if report["checkpoint"]["step"] == steps else None


def _previous_arms(path: Path) -> dict[str, Any]:
    import json

    try:
        return json.loads(path.read_text()).get("arms", {})
    except (OSError, ValueError):
        return {}


def _round(x: Optional[float]) -> Optional[float]:
    return None if x is None else round(x, 1)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpu", action="store_true", help="the single-GPU sizes (default: the 2-core CPU sizes)")
    ap.add_argument("--smoke", action="store_true", help="a few steps per arm (tests)")
    ap.add_argument("--out", default="runs/reproduce", help="where results, logs and runs go (default runs/reproduce)")
    ap.add_argument("--data-dir", default=None, help="prepared data folder (default: the recipe's data.dir)")
    ap.add_argument("--arms", default=None, help="comma-separated arm names to run (default: all)")
    args = ap.parse_args(argv)
    scale_name = "smoke" if args.smoke else "gpu" if args.gpu else "cpu"
    scale = SCALES[scale_name]
    out = Path(args.out).resolve()
    log = out / "hmem.log"
    common = dict(scale.overrides)
    if args.data_dir:
        common["data.dir"] = str(Path(args.data_dir).resolve())
    if args.gpu:
        common["parallel.precision"] = "auto"
    recipe = ROOT / RECIPE
    base = parameter_counts(recipe, argv_overrides({**common, **NO_MEMORY}))
    from memtrain.config import load_recipe

    base_recipe = load_recipe(recipe, argv_overrides(common))
    plan = arms(scale, base_recipe.model.ffn_dim)
    if args.arms:
        wanted = set(args.arms.split(","))
        unknown = wanted - {a.name for a in plan}
        if unknown:
            ap.error(f"unknown arm(s) {', '.join(sorted(unknown))}; choose from {', '.join(a.name for a in plan)}")
        plan = [a for a in plan if a.name in wanted]

    previous = _previous_arms(out / "hmem.json")
    start = time.perf_counter()
    results: dict[str, Any] = {"scale": scale_name, "recipe": RECIPE, "s1": scale.s1, "s2": scale.s2,
                               "tokens_per_step": base_recipe.tokens_per_step, "anchor_params": base["anchor"],
                               "device": "cuda" if args.gpu else f"cpu ({os.cpu_count()} cores)", "arms": {}}
    print(f"reproduce-hmem ({scale_name}): {len(plan)} arms; log {log}", flush=True)
    seconds = {"prepare": memtrain("prepare", recipe, *argv_overrides(common), log=log)}
    for arm in plan:
        overrides = {**common, **arm.overrides, "run.name": f"reproduce-hmem-{arm.name}",
                     "run.dir": str(out / "runs" / arm.name)}
        if arm.init_from:
            overrides["model.init_from"] = str(out / "runs" / arm.init_from)
        argv = argv_overrides(overrides)
        report = finished(out / "runs" / arm.name, arm.overrides["train.max_steps"])
        if report is None:  # not run yet, or interrupted: train (resuming) and evaluate
            t = time.perf_counter()
            memtrain("train", recipe, *argv, log=log)
            train_s = time.perf_counter() - t
            eval_s = memtrain("eval", recipe, *argv, "--modes", arm.modes, log=log)
            report = newest_eval(out / "runs" / arm.name)
        else:  # a previous invocation trained and evaluated this arm: keep its timings
            train_s, eval_s = previous.get(arm.name, {}).get("train_seconds"), previous.get(arm.name, {}).get("eval_seconds")
        shown = {k: v for k, v in overrides.items() if k not in common or k == "data.dir"}
        results["arms"][arm.name] = {
            "label": arm.label, "overrides": {k: v for k, v in overrides.items() if k not in common},
            "command": shell_command("train", shown),
            "eval_command": f"{shell_command('eval', shown)} --modes {arm.modes}",
            "params": parameter_counts(recipe, argv), "train_seconds": _round(train_s),
            "eval_seconds": _round(eval_s), "eval": summarize(report)}
        results["probes"] = report["probes"]["count"]
        results["buckets"] = report["probes"]["buckets"]
        print(f"  {arm.name}: trained in {train_s} s, evaluated in {eval_s} s", flush=True)
    memory_arms = {a.name: argv_overrides({**common, **a.overrides, "run.dir": str(out / "runs" / a.name)})
                   for a in plan if a.name in ("a2-32x", "a4-32x")}
    t = time.perf_counter()
    results["retrieval"] = retrieval_analysis(recipe, argv_overrides(common), memory_arms)
    seconds["retrieval"] = round(time.perf_counter() - t, 1)
    for name, r in results["retrieval"]["arms"].items():  # the same scoring as `memtrain eval`: same counts
        reported = results["arms"][name]["eval"]["modes"]["fetched"]["all"]["correct"]
        if r["fetched"]["all"]["correct"] != reported:
            raise ReproError(f"{name}: oracle scoring with the prompt's ids found {r['fetched']['all']['correct']} "
                             f"probes correct but `memtrain eval` reported {reported}")
    results["seconds_by_step"] = seconds
    results["arm_seconds"] = round(sum((a["train_seconds"] or 0) + (a["eval_seconds"] or 0)
                                       for a in results["arms"].values()), 1)
    results["seconds"] = round(time.perf_counter() - start, 1)
    js, md = write_results(out, "hmem", results, markdown(results))
    png = plot(results, out / "hmem.png")
    print(f"wrote {js}, {md}, {png}", flush=True)
    return results


if __name__ == "__main__":
    run_script(main, "reproduce-hmem")
