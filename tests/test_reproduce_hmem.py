"""reproduce/hmem.py (hierarchical memories at small scale): the arms keep the comparisons fair (same
seed, data and schedule; the same tokens for the arms compared), the bank sweep holds the fetched size
fixed while the bank grows 1x-32x the anchor, the iso-parameters anchor matches anchor + fetched memory,
and the report (JSON summary, Markdown with the paper's numbers, plot) is built from `memtrain eval`
reports."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from memtrain.config import load_recipe

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("reproduce_hmem", ROOT / "reproduce" / "hmem.py")
hmem = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = hmem  # dataclasses look their module up while the script is executed
spec.loader.exec_module(hmem)
RECIPE = ROOT / hmem.RECIPE


def plan(scale="cpu"):
    s = hmem.SCALES[scale]
    base = load_recipe(RECIPE, hmem.argv_overrides(s.overrides))
    return {a.name: a for a in hmem.arms(s, base.model.ffn_dim)}, s


def recipe_of(arm, scale):
    return load_recipe(RECIPE, hmem.argv_overrides({**hmem.SCALES[scale].overrides, **arm.overrides}))


@pytest.mark.parametrize("scale", ["cpu", "gpu", "smoke"])
def test_arms_validate_and_compare_like_with_like(scale):
    arms, s = plan(scale)
    recipes = {name: recipe_of(a, scale) for name, a in arms.items()}
    # Same seed, data, batch for every arm.
    for r in recipes.values():
        assert r.run.seed == recipes["anchor"].run.seed
        assert r.to_dict()["data"] == recipes["anchor"].to_dict()["data"]
        assert r.tokens_per_step == recipes["anchor"].tokens_per_step
    # Stage 2 arms start from the anchor with one schedule and step count; their baseline reads the same tokens.
    stage2 = [n for n, a in arms.items() if a.init_from]
    assert set(stage2) == {"anchor-continued", "a2-1x", "a2-4x", "a2-16x", "a2-32x"}
    for n in stage2:
        assert arms[n].init_from == "anchor"
        r = recipes[n]
        assert (r.max_steps, r.train.optimizer.lr, r.train.schedule.min_lr) == (s.s2, 1e-3, 1e-4)
    # From-scratch arms (A4, its baseline, iso-parameters) share steps and schedule with the anchor.
    for n in ("anchor-scratch", "a4-32x", "iso-params"):
        r = recipes[n]
        assert arms[n].init_from is None and r.max_steps == s.s1 + s.s2
        assert r.train.optimizer.lr == recipes["anchor"].train.optimizer.lr
    assert recipes["anchor"].max_steps == s.s1
    assert not recipes["anchor"].memory.enabled and recipes["a4-32x"].memory.enabled


@pytest.mark.parametrize("scale", ["cpu", "gpu"])
def test_bank_sweep_fixes_the_fetched_size_and_iso_parameters_match(scale):
    arms, s = plan(scale)
    counts = {n: hmem.parameter_counts(RECIPE, hmem.argv_overrides({**s.overrides, **a.overrides}))
              for n, a in arms.items()}
    anchor = counts["anchor"]["anchor"]
    fetched = {counts[f"a2-{t}"]["fetched"] for t in hmem.SWEEP_LEVELS}
    assert len(fetched) == 1, fetched
    fetched = fetched.pop()
    assert 0.08 < fetched / anchor < 0.12  # about a tenth of the anchor (Section 3)
    ratios = {t: counts[f"a2-{t}"]["bank"] / anchor for t in hmem.SWEEP_LEVELS}
    for tag, ratio in ratios.items():
        target = float(tag.removesuffix("x"))
        assert abs(ratio - target) / target < 0.15, ratios
    # The iso-parameters anchor has exactly anchor + fetched parameters (its FFN is wider by the fetched units).
    assert counts["iso-params"]["anchor"] == anchor + fetched
    assert counts["a2-32x"]["anchor"] == anchor


def fake_report(step, modes, correct):
    buckets = {"head": 15, "torso": 140, "tail": 828}
    cell = lambda c, n: {"accuracy": c / n, "correct": c, "count": n}  # noqa: E731
    return {"checkpoint": {"step": step, "tokens_seen": step * 4096},
            "perplexity": {m: {"perplexity": 2.0 + i} for i, m in enumerate(modes) if m in ("fetched", "generic", "none")},
            "probes": {"count": 983, "buckets": buckets,
                       "modes": {m: {"all": cell(sum(correct[m]), 983),
                                     "buckets": {b: cell(c, buckets[b]) for b, c in zip(hmem.BUCKETS, correct[m])}}
                                 for m in modes}}}


def test_summary_markdown_and_plot(tmp_path):
    arms, s = plan("cpu")
    results = {"scale": "cpu", "device": "cpu", "s1": s.s1, "s2": s.s2, "tokens_per_step": 4096, "seconds": 60.0,
               "arm_seconds": 600.0, "seconds_by_step": {"prepare": 1.0, "retrieval": 30.0},
               "probes": 983, "buckets": {"head": 15, "torso": 140, "tail": 828}, "arms": {}}
    for name, arm in arms.items():
        modes = arm.modes.split(",")
        correct = {m: (8, 30, 60 + i) for i, m in enumerate(modes)}
        summary = hmem.summarize(fake_report(200, modes, correct))
        results["arms"][name] = {"label": arm.label, "command": f"memtrain train {name}", "eval": summary,
                                 "params": {"anchor": 1_000_000, "fetched": 100_000 if arm.modes != "none" else 0,
                                            "bank": 32_000_000 if arm.modes != "none" else 0}}
    m = results["arms"]["a2-32x"]["eval"]["modes"]
    assert m["fetched"]["tail"] == {"accuracy": 60 / 828, "correct": 60, "count": 828}
    assert m["fetched"]["perplexity"] == 2.0 and m["blocked"]["perplexity"] is None
    cell = {"accuracy": 0.5, "correct": 10, "count": 20}
    table = {"all": cell, "buckets": {b: cell for b in hmem.BUCKETS}}
    results["retrieval"] = {"agreement": {f"level{l}": {b: 1 / l for b in ("all", *hmem.BUCKETS)} for l in (1, 2, 3)},
                            "used_leaves": 400, "entities_per_used_leaf_mean": 1.5, "leaves_per_entity_mean": 2.0,
                            "arms": {"a2-32x": {"step": 200, "fetched": table, "oracle": table}}}
    md = hmem.markdown(results)
    assert "| all | 100.0% | 50.0% | 33.3% |" in md and "| a2-32x | oracle | 50.0% (10) |" in md
    row = next(line for line in md.splitlines() if line.startswith("| a2-32x") and "| generic |" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2:] == ["generic", "1.00M", "100k", "32.0M (32.0x)", "3.000", "10.1% (99)", "53.3% (8)",
                         "21.4% (30)", "7.4% (61)"]
    assert "Avg-SK 40.3% fetched, 35.7% generic" in md and "Bank size at a fixed fetched size" in md
    png = hmem.plot(results, tmp_path / "hmem.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_finished_arm_is_not_run_again(tmp_path):
    import json

    run = tmp_path / "runs" / "anchor"
    assert hmem.finished(run, 300) is None  # never run
    (run / "eval").mkdir(parents=True)
    (run / "eval" / "global_step100.json").write_text(json.dumps({"checkpoint": {"step": 100}}))
    assert hmem.finished(run, 300) is None  # interrupted at step 100: train (resume) and evaluate again
    (run / "eval" / "global_step300.json").write_text(json.dumps({"checkpoint": {"step": 300}}))
    assert hmem.finished(run, 300)["checkpoint"]["step"] == 300


def test_retrieval_agreement_counts_probes_that_reach_their_entitys_clusters(tmp_path, monkeypatch):
    """Prepared with hashed-word embeddings (tests/test_eval.py's stand-in for MiniLM); a probe whose
    prompt is one of its entity's documents reaches that document's cluster at every level, and the
    shares are per level and bucket."""
    from memtrain.data import embed, longtail
    from memtrain.data.prepare import prepare
    from tests.test_eval import HashEmbedder

    monkeypatch.setattr(embed, "load_embedder", lambda name="", device=None: HashEmbedder())
    overrides = hmem.argv_overrides({"data.dir": str(tmp_path / "data"), "data.clustering.kmeans_samples": 256})
    prepare(load_recipe(RECIPE, overrides))
    real = longtail.probes(seed=0)
    first_doc = {}
    for d in longtail.longtail_corpus(seed=0):
        first_doc.setdefault(d.entity, d.text)
    echo = [type(p)(**{**p.__dict__, "prompt": first_doc[p.entity]}) for p in real[:40]]
    monkeypatch.setattr(longtail, "probes", lambda seed=0: echo)
    r = hmem.retrieval_analysis(RECIPE, overrides, {})
    assert {level: rates["all"] for level, rates in r["agreement"].items()} == {"level1": 1.0, "level2": 1.0,
                                                                                  "level3": 1.0}
    assert r["entities_per_used_leaf_mean"] >= 1.0 and r["leaves_per_entity_mean"] >= 1.0
    assert 1 <= r["used_leaves"] <= 8 ** 3 and r["arms"] == {}

    monkeypatch.setattr(longtail, "probes", lambda seed=0: real)
    r = hmem.retrieval_analysis(RECIPE, overrides, {})
    for b in ("all", *hmem.BUCKETS):
        levels = [r["agreement"][f"level{l}"][b] for l in (1, 2, 3)]
        assert all(0.0 <= v <= 1.0 for v in levels) and levels == sorted(levels, reverse=True), (b, levels)


def test_a_corrupted_report_is_evaluated_again_not_a_traceback(tmp_path):
    from common import ReproError, newest_eval

    run = tmp_path / "runs" / "anchor"
    (run / "eval").mkdir(parents=True)
    bad = run / "eval" / "global_step300.json"
    bad.write_text('{"checkpoint": {"step": 3')  # cut off mid-write
    with pytest.raises(ReproError, match="global_step300.json is not valid JSON") as e:
        newest_eval(run)
    assert "\n" not in str(e.value) and bad.exists()  # one line; nothing deleted behind the user's back
    assert hmem.finished(run, 300) is None  # the script trains (resumes) and evaluates the arm again
