"""reproduce/titans.py (Titans Table 2 at small scale): the arms' recipes validate at every scale with
the same shared settings, and the results (JSON summary, Markdown table with the paper's rows, plot)
are built correctly from an evaluation report."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from memtrain.config import load_recipe

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("reproduce_titans", ROOT / "reproduce" / "titans.py")
titans = importlib.util.module_from_spec(spec)
spec.loader.exec_module(titans)

SHARED = ("data.", "train.", "run.seed", "model.d_model", "model.n_layers", "model.n_heads", "model.vocab_size")


@pytest.mark.parametrize("scale", ["cpu", "gpu", "smoke"])
def test_every_arm_validates_and_shares_the_training_settings(scale, tmp_path):
    cfg = titans.SCALES[scale]
    recipes = {}
    for arm in titans.ARMS:
        o = titans.arm_overrides(arm, cfg, tmp_path / arm, tmp_path / "data")
        recipes[arm] = load_recipe(titans.RECIPE, titans.argv_overrides(o)).to_dict()
    flat = {arm: _flatten(r) for arm, r in recipes.items()}
    for key in flat["titans-mac"]:
        if key.startswith(SHARED) and key != "data.dir":
            values = {arm: f.get(key) for arm, f in flat.items()}
            assert len(set(map(repr, values.values()))) == 1, (key, values)
    T = cfg["context"]
    assert recipes["titans-mac"]["model"]["titans"]["segment_len"] == T // 4
    assert recipes["transformer-swa"]["model"]["attention_window"] == T // 4
    assert recipes["transformer-full"]["model"]["attention_window"] is None
    assert recipes["transformer-full"]["model"]["max_seq_len"] >= 8 * T
    assert recipes["titans-lmm"]["model"]["titans"]["variant"] == "lmm"


def test_parameter_counts_within_ten_percent():
    import torch

    from memtrain.model import build, count_parameters

    counts = {}
    for arm in titans.ARMS:
        o = titans.arm_overrides(arm, titans.SCALES["cpu"], Path("/tmp/x"), Path("/tmp/d"))
        r = load_recipe(titans.RECIPE, titans.argv_overrides(o))
        with torch.device("meta"):
            counts[arm] = count_parameters(build(r.model))
    assert max(counts.values()) / min(counts.values()) < 1.10, counts


def _flatten(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def fake_report(context: int, acc: dict[str, list[float]]) -> dict:
    lengths = [context * m for m in titans.MULTIPLES]
    return {
        "perplexity": {"none": {"perplexity": 12.5, "tokens": 100}},
        "long_context": {
            "lengths": lengths, "truncated": 0, "context": {"mode": "stream"},
            "by_task_length": {t: {str(n): {"accuracy": a, "count": 4} for n, a in zip(lengths, accs)}
                               for t, accs in acc.items()},
        },
    }


def test_summary_table_and_plot_from_a_report(tmp_path):
    T = 256
    acc = {"passkey": [1.0, 0.75, 0.5, 0.25], "number": [1.0, 0.5, 0.0, 0.0], "word": [0.5, 0.5, 0.5, 0.5],
           "qa1": [1.0, 1.0, 0.0, 0.0], "qa2": [0.0, 0.0, 0.0, 0.0]}
    arm = titans.summarize("titans-mac", fake_report(T, acc), 1_600_000, 10.0, 5.0, [0.5, 0.7], T)
    assert arm["val_perplexity"] == 12.5 and arm["seconds_per_step"] == 0.6
    assert arm["accuracy"]["number"] == {"1x": 1.0, "2x": 0.5, "4x": 0.0, "8x": 0.0}
    assert arm["niah_mean"]["2x"] == pytest.approx((0.75 + 0.5 + 0.5) / 3)
    assert arm["babilong_mean"]["1x"] == pytest.approx(0.5)
    results = {"settings": {"context": T, "d_model": 128, "n_layers": 4, "steps": 10, "batch_tokens": 4096,
                            "samples": 4, "tasks": ["passkey", "number", "word", "qa1", "qa2"]},
               "arms": {"titans-mac": arm}}
    md = titans.markdown(results)
    row = next(line for line in md.splitlines() if line.startswith("| titans-mac"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:3] == ["titans-mac", "1,600,000", "12.50"]
    assert cells[3:7] == ["100.0%", "75.0%", "50.0%", "25.0%"]  # PK 1x..8x
    assert cells[-4:] == ["50.0%", "50.0%", "0.0%", "0.0%"]  # BABILong mean
    paper = next(line for line in md.splitlines() if line.startswith("| paper: Titans (MAC)"))
    assert "99.2%" in paper and "95.2%" in paper
    header = md.splitlines()[[i for i, l in enumerate(md.splitlines()) if l.startswith("| arm")][0]]
    assert len(header.split("|")) == len(row.split("|"))
    png = titans.plot(results, tmp_path / "titans.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tasks_leave_out_qa3_only_where_its_facts_do_not_fit():
    assert "qa3" not in titans.tasks_for(256) and "qa3" in titans.tasks_for(2048)
    assert titans.tasks_for(256)[:3] == ["passkey", "number", "word"]
