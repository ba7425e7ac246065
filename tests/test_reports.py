"""`memtrain status` and `memtrain scaling` (memtrain/launcher/reports.py) on run directories built here:
metrics.jsonl rows, TensorBoard events of known values, recipe.yaml, checkpoint folders marked complete,
attempts.jsonl and run.lock, as the trainer writes them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memtrain.config import recipe_from_dict
from memtrain.errors import MemtrainError
from memtrain.launcher.reports import ReportError, format_status, run_status, scaling_report, warmup_skip
from memtrain.parallel.checkpoint_folder import mark_complete, partial_tag_for, tag_for
from memtrain.parallel.run_lock import identity

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _recipe(run_dir: Path, **train) -> dict:
    return {"run": {"name": "scale", "dir": str(run_dir)},
            "model": {"vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 2, "ffn_dim": 128, "max_seq_len": 64},
            "data": {"seq_len": 64, "tokenizer": {"vocab_size": 256}},
            "train": {"max_steps": 100, "global_batch_tokens": 4096, "micro_batch_size": 4, **train}}


def _write_recipe(run_dir: Path, data: dict) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "recipe.yaml").write_text(recipe_from_dict(data).to_yaml(), encoding="utf-8")


def _checkpoint(run_dir: Path, step: int, world: int, permanent: bool = False, complete: bool = True) -> None:
    folder = run_dir / "checkpoints" / tag_for(step)
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"step": step}), encoding="utf-8")
    if complete:
        mark_complete(folder, step, permanent, world)


def _jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def _start(t: float, world: int, resumed: int | None, pid: int = 111, restart: int | None = None) -> dict:
    return {"event": "start", "time": t, "host": "node7", "pid": pid, "slurm_job_id": "4242",
            "slurm_restart_count": restart, "world_size": world, "resumed_from_step": resumed}


# --------------------------------------------------------------------------------------------------
# status


def _status_run(tmp_path: Path) -> Path:
    """A 2-rank run logged every 10 steps to step 50 (step 50's loss non-finite), validated at step 40,
    checkpoints 20 (permanent) and 40, an incomplete global_step50 and a partial save of 60; preempted at
    step 20 and restarted once."""
    run = tmp_path / "run"
    _write_recipe(run, _recipe(run))
    rows = []
    for i, step in enumerate(range(10, 60, 10)):
        rows.append({"step": step, "time": 1000.0 + step, "loss/train": 5.0 - 0.5 * i, "loss/nonfinite_steps": 0.0,
                     "throughput/tokens_per_sec": 1000.0 + 100 * i, "throughput/device/tokens_per_sec": 500.0 + 50 * i,
                     "throughput/step_time_s": 4.0, "throughput/data_wait_frac": 0.1,
                     "progress/tokens_seen": float(4096 * step)})
    rows[3]["loss/val"] = 3.75
    rows[4]["loss/train"] = None  # a skipped step: written as null
    rows[4]["loss/nonfinite_steps"] = 1.0
    _jsonl(run / "metrics.jsonl", rows)
    _checkpoint(run, 20, 2, permanent=True)
    _checkpoint(run, 40, 2)
    _checkpoint(run, 50, 2, complete=False)
    (run / "checkpoints" / partial_tag_for(60)).mkdir()
    _jsonl(run / "attempts.jsonl", [_start(900.0, 2, None), {"event": "end", "time": 1020.5, "state": "preempted",
                                                             "step": 20},
                                    _start(1030.0, 2, 20, pid=222, restart=1)])
    return run


def test_status_fields(tmp_path):
    run = _status_run(tmp_path)
    s = run_status(run)
    assert s["name"] == "scale" and s["run_dir"] == str(run)
    assert s["max_steps"] == 100
    assert s["last_step"] == 50 and s["last_time"] == 1050.0
    assert s["tokens_seen"] == 4096 * 50
    assert (s["loss_train"], s["loss_train_step"]) == (3.5, 40)  # the last finite one
    assert (s["loss_val"], s["loss_val_step"]) == (3.75, 40)
    assert s["nonfinite_steps"] == 1
    assert s["tokens_per_sec"] == pytest.approx((1000 + 1100 + 1200 + 1300 + 1400) / 5)
    assert s["tokens_per_sec_device"] == pytest.approx((500 + 550 + 600 + 650 + 700) / 5)
    assert s["mfu"] is None and s["step_time_s"] == 4.0 and s["data_wait_frac"] == pytest.approx(0.1)
    assert [(c["step"], c["permanent"], c["world_size"]) for c in s["checkpoints"]] == [(20, True, 2), (40, False, 2)]
    assert [Path(p).name for p in s["incomplete_checkpoints"]] == ["global_step50"]
    assert len(s["attempts"]) == 2 and s["restarts"] == 1
    assert s["attempts"][0]["end"] == {"time": 1020.5, "state": "preempted", "step": 20}
    assert s["attempts"][1]["end"] is None and s["attempts"][1]["resumed_from_step"] == 20
    assert s["state"] == "crashed"  # the second start has no end and no lock names a live process

    text = format_status(s, now=1050.0 + 120)
    lines = text.splitlines()
    value_col = lines[0].index("scale")
    assert all(line[value_col - 2:value_col] == "  " for line in lines)  # aligned
    assert lines[0].startswith("run ")
    assert "crashed" in lines[1] and "2 start(s), 1 restart(s)" in lines[1]
    assert "50 / 100 (50%)" in text and "(2.0 min ago)" in text
    assert "204.80k (204800)" in text
    assert "train 3.5000 (step 40), val 3.7500 (step 40), 1 non-finite step(s) skipped" in text
    assert "1.20k tok/s, 600.0 tok/s per device" in text
    assert "step 20 (2 ranks, permanent), step 40 (2 ranks)" in text
    assert "global_step50" in text and "60" not in text.split("incomplete", 1)[1].splitlines()[0]
    assert "#1 " in text and "preempted at step 20" in text
    assert "#2 " in text and "resumed at step 20 -> no end recorded" in text and "job 4242 restart 1" in text
    # stopped at step 53 by a signal, logged last at 50: the step line says how far it got and what was logged
    _jsonl(run / "attempts.jsonl", [{"event": "end", "time": 1060.0, "state": "preempted", "step": 53}])
    text = format_status(run_status(run), now=1050.0 + 120)
    assert "53 / 100 (53%); the last logged step 50, logged" in text and "(204800, at step 50)" in text


def test_status_states(tmp_path):
    run = _status_run(tmp_path)
    # A live lock on this host: running (this test process holds it).
    (run / "run.lock").write_text(json.dumps(identity()), encoding="utf-8")
    s = run_status(run)
    assert s["state"] == "running" and str(os.getpid()) in s["state_detail"]
    # A lock whose process is gone: the start without an end is a crash.
    dead = identity() | {"pid": 2**22 + 12345}
    (run / "run.lock").write_text(json.dumps(dead), encoding="utf-8")
    assert run_status(run)["state"] == "crashed"
    # Held on another host: cannot be checked from here.
    (run / "run.lock").write_text(json.dumps(identity() | {"host": "elsewhere-node"}), encoding="utf-8")
    assert run_status(run)["state"] == "running or crashed"
    # A lock file that cannot be read (cut short): said so, not "held by pid None on None"
    (run / "run.lock").write_text('{"host": "node', encoding="utf-8")
    s = run_status(run)
    assert s["state"] == "running or crashed" and "run.lock exists but cannot be read" in s["state_detail"]
    assert "None" not in s["state_detail"]
    (run / "run.lock").unlink()
    # An orderly end.
    _jsonl(run / "attempts.jsonl", [{"event": "end", "time": 2000.0, "state": "complete", "step": 100}])
    s = run_status(run)
    assert (s["state"], s["restarts"]) == ("complete", 1) and "step 100" in s["state_detail"]
    # A torn last line (a kill mid-write) is skipped; a third start counts as a restart.
    _jsonl(run / "attempts.jsonl", [_start(3000.0, 4, 40, pid=333, restart=2)])
    with open(run / "attempts.jsonl", "a", encoding="utf-8") as f:
        f.write('{"event": "end", "ti')
    s = run_status(run)
    assert (s["state"], s["restarts"], s["attempts"][-1]["world_size"]) == ("crashed", 2, 4)


def test_status_names_a_damaged_marker_apart_from_incomplete_ones(tmp_path):
    """A checkpoint whose COMPLETE.json exists but cannot be parsed is damaged, not "incomplete (no COMPLETE.json)":
    status lists it with the problem and, for one newer than every complete checkpoint, the fallback the trainer
    names when it refuses to resume."""
    run = _status_run(tmp_path)
    _checkpoint(run, 30, 2)
    _checkpoint(run, 45, 2)
    for step in (30, 45):
        marker = run / "checkpoints" / tag_for(step) / "COMPLETE.json"
        marker.write_bytes(marker.read_bytes()[:30])
    s = run_status(run)
    assert [c["step"] for c in s["checkpoints"]] == [20, 40]
    assert [Path(p).name for p in s["incomplete_checkpoints"]] == ["global_step50"]
    old, new = s["damaged_checkpoints"]
    assert (old["step"], old["fix"]) == (30, None) and old["problem"].startswith("COMPLETE.json cannot be parsed (")
    root = run / "checkpoints"
    assert new["step"] == 45 and new["fix"] == f"delete {root / 'global_step45' / 'COMPLETE.json'} to resume from " \
                                               f"{root / 'global_step40'}"
    text = format_status(s, now=2000.0)
    damaged = [line for line in text.splitlines() if "global_step30:" in line or "global_step45:" in line]
    assert damaged[0].startswith("damaged ") and "global_step30: COMPLETE.json cannot be parsed (" in damaged[0]
    assert damaged[0].endswith("older than the newest complete checkpoint: kept, never resumed from or pruned")
    assert damaged[1].endswith(f"; {new['fix']}")
    assert "global_step50 (no COMPLETE.json: never resumed from)" in text


def test_a_record_after_a_torn_line_starts_a_line_of_its_own(tmp_path):
    """A crash mid-write leaves attempts.jsonl without its last newline; the next attempt's records used to be
    appended to that line, unreadable, and status reported the old attempt's state. The fragment stays one
    unreadable line (skipped, like a torn metrics.jsonl row) and the new records are read."""
    from memtrain.launcher.train import _record_attempt

    run = _status_run(tmp_path)
    with open(run / "attempts.jsonl", "a", encoding="utf-8") as f:
        f.write('{"event": "end", "ti')  # the second attempt's end, cut short
    _record_attempt(run, _start(3000.0, 4, 40, pid=333))
    _record_attempt(run, {"event": "end", "time": 3100.0, "state": "complete", "step": 100})
    lines = (run / "attempts.jsonl").read_text(encoding="utf-8").splitlines()
    assert lines[-3] == '{"event": "end", "ti' and json.loads(lines[-2])["pid"] == 333
    s = run_status(run)
    assert (s["state"], s["restarts"], s["attempts"][-1]["pid"]) == ("complete", 2, 333)
    assert s["attempts"][1]["end"] is None  # the torn end stays unknown
    _record_attempt(run, {"event": "end", "time": 3200.0, "state": "failed", "step": 100})  # a file that ends well
    assert (run / "attempts.jsonl").read_text(encoding="utf-8").count("\n\n") == 0


def test_an_end_without_its_start_is_an_attempt(tmp_path):
    """An end record whose start line was lost (torn, or appended to a torn line by an older trainer) is an attempt
    of its own: it was dropped, so status showed the previous attempt's end as the run's state and one restart
    too few."""
    run = _status_run(tmp_path)
    _jsonl(run / "attempts.jsonl", [{"event": "end", "time": 1500.0, "state": "preempted", "step": 30}])
    with open(run / "attempts.jsonl", "a", encoding="utf-8") as f:
        f.write('{"event": "end", "ti{"event": "start", "time": 1600.0}\n')  # a start swallowed by a torn line
    _jsonl(run / "attempts.jsonl", [{"event": "end", "time": 1700.0, "state": "complete", "step": 100}])
    s = run_status(run)
    assert (s["state"], s["state_detail"], s["restarts"]) == ("complete", "at step 100", 2)
    assert s["attempts"][-1] == {"start_lost": True, "end": {"time": 1700.0, "state": "complete", "step": 100}}
    text = format_status(s, now=2000.0)
    assert "#3 " in text and "start not recorded (torn or missing line) -> complete at step 100" in text


def test_status_without_steps_or_attempts(tmp_path):
    run = tmp_path / "fresh"
    _write_recipe(run, _recipe(run, max_steps="1M tokens"))
    s = run_status(run)
    assert s["max_steps"] == 245  # ceil(1e6 / 4096)
    assert s["last_step"] is None and s["checkpoints"] == [] and s["restarts"] == 0 and s["state"] == "unknown"
    text = format_status(s)
    assert "no step logged yet (of 245)" in text and "none complete" in text


def test_status_errors(tmp_path):
    with pytest.raises(ReportError, match=r"run directory .*nope does not exist; pass the run.dir"):
        run_status(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReportError, match=r"empty holds no training run .*pass the run.dir that `memtrain train` wrote"):
        run_status(tmp_path / "empty")
    assert issubclass(ReportError, MemtrainError) and ReportError.exit_code == 2


# --------------------------------------------------------------------------------------------------
# scaling


# Per-device tokens/s of the 10 logged steps: two slow warm-up steps, then values whose median is known.
PER_DEVICE = {1: [10, 50, 100, 102, 98, 101, 99, 100, 103, 97],  # median after warm-up: 100
              2: [5, 40, 90, 92, 88, 91, 89, 90, 93, 87],  # 90
              4: [3, 30, 80, 82, 78, 81, 79, 80, 83, 77]}  # 80
STEP_TIME = {1: 0.5, 2: 0.5, 4: 0.5}
SPLIT = {"forward": 0.125, "backward": 0.25, "optimizer": 0.0625, "data": 0.0625}  # of 0.5 s


def _tb_run(root: Path, name: str, world: int, *, split: bool = True, bank: bool = True, recipe: dict | None = None,
            tags: dict[str, list[float]] | None = None) -> Path:
    from torch.utils.tensorboard import SummaryWriter

    run = root / name
    _write_recipe(run, recipe or _recipe(run))
    w = SummaryWriter(log_dir=str(run / "tensorboard"))
    try:
        if tags is not None:
            for tag, values in tags.items():
                for i, v in enumerate(values):
                    w.add_scalar(tag, v, 10 * (i + 1))
            return run
        for i, dev in enumerate(PER_DEVICE[world]):
            step = 10 * (i + 1)
            w.add_scalar("loss/train", 4.0, step)
            w.add_scalar("throughput/tokens_per_sec", dev * world, step)
            w.add_scalar("throughput/device/tokens_per_sec", dev, step)
            w.add_scalar("throughput/mfu", dev / 400, step)
            w.add_scalar("throughput/step_time_s", STEP_TIME[world] * (4 if i < 2 else 1), step)
            w.add_scalar("throughput/data_wait_frac", 0.25 if i % 2 else 0.125, step)
            w.add_scalar("comm/anchor_bytes_sent", 1_000_000.0 * (world - 1) + i, step)
            if split:
                for part, t in SPLIT.items():
                    w.add_scalar(f"time/{part}_s", t, step)
            if bank:
                w.add_scalar("comm/bank_bytes_sent", 250_000.0 * world, step)
    finally:
        w.close()
    _checkpoint(run, 100, world)
    return run


def _table(md: str) -> list[dict[str, str]]:
    lines = [l for l in md.splitlines() if l.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in l.strip("|").split("|")))) for l in lines[2:]]


def test_scaling_report(tmp_path):
    runs = tmp_path / "runs"
    r4 = _tb_run(runs, "w4", 4, split=False, bank=False)
    r1 = _tb_run(runs, "w1", 1)
    r2 = _tb_run(runs, "w2", 2)
    out = tmp_path / "report"
    report = scaling_report([r4, r1, r2], out)

    rows = report["runs"]
    assert [r["world_size"] for r in rows] == [1, 2, 4] and report["baseline"] == "w1"
    assert all(r["world_size_source"] == "logged throughput ratio" for r in rows)
    assert all(r["steps_used"] == 8 and r["steps_logged"] == 10 and r["first_step_used"] == 30 for r in rows)
    base = 100.0
    for r, dev in zip(rows, (100.0, 90.0, 80.0)):
        assert r["tokens_per_sec_device"] == dev
        assert r["tokens_per_sec"] == dev * r["world_size"]
        assert r["efficiency"] == pytest.approx(dev / base)
        assert r["mfu"] == pytest.approx(dev / 400, rel=1e-6)
        assert r["step_time_s"] == 0.5  # the two 2 s warm-up steps left out
        assert r["data_wait_frac"] == pytest.approx(0.1875)  # median of four 0.125 and four 0.25
        assert r["anchor_bytes_sent"] == 1_000_000.0 * (r["world_size"] - 1) + 5.5  # median of i = 2..9
    assert rows[0]["split"] == {"forward": 0.25, "backward": 0.5, "optimizer": 0.125, "data": 0.125}
    assert rows[2]["split"] == dict.fromkeys(SPLIT) and rows[2]["bank_bytes_sent"] is None
    assert rows[1]["bank_bytes_sent"] == 500_000.0

    md = Path(report["markdown"]).read_text(encoding="utf-8")
    assert report["markdown"] == str(out / "scaling.md")
    table = _table(md)
    assert [t["run"] for t in table] == ["w1", "w2", "w4"]
    assert [t["ranks"] for t in table] == ["1", "2", "4"]
    assert [t["tokens/s"] for t in table] == ["100.0", "180.0", "320.0"]
    assert [t["tokens/s per device"] for t in table] == ["100.0", "90.0", "80.0"]
    assert [t["scaling efficiency (%)"] for t in table] == ["100.0", "90.0", "80.0"]
    assert [t["MFU (%)"] for t in table] == ["25.0", "22.5", "20.0"]
    assert [t["step time (s)"] for t in table] == ["0.5000"] * 3
    assert [t["data wait (%)"] for t in table] == ["18.8"] * 3
    assert [t["forward (% of step)"] for t in table] == ["25.0", "25.0", ""]
    assert [t["backward (% of step)"] for t in table] == ["50.0", "50.0", ""]
    assert [t["optimizer (% of step)"] for t in table] == ["12.5", "12.5", ""]
    assert [t["data (% of step)"] for t in table] == ["12.5", "12.5", ""]
    assert [t["anchor sent per step (MB, rank 0)"] for t in table] == ["0.000", "1.000", "3.000"]
    assert [t["bank sent per step (MB, rank 0)"] for t in table] == ["0.250", "0.500", ""]
    assert [t["steps used"] for t in table] == ["8 of 10"] * 3
    assert "recipes differ" not in md
    assert "scaling efficiency = tokens/s per device / that of w1 (1 rank, the fewest)" in md

    png = Path(report["png"])
    assert png == out / "scaling.png"
    data = png.read_bytes()
    assert len(data) > 0 and data[:8] == PNG_MAGIC


def test_scaling_flags_different_recipes(tmp_path):
    runs = tmp_path / "runs"
    r1 = _tb_run(runs, "w1", 1)
    r2 = _tb_run(runs, "w2", 2, recipe=_recipe(runs / "w2", global_batch_tokens=8192) | {
        "model": _recipe(runs)["model"] | {"d_model": 128}})
    report = scaling_report([r2, r1], tmp_path / "out")
    md = (tmp_path / "out" / "scaling.md").read_text(encoding="utf-8")
    note = [n for n in report["notes"] if n.startswith("recipes differ")]
    assert len(note) == 1 and "w2 has" in note[0] and "(vs w1)" in note[0]
    assert "model.d_model 128 instead of 64" in note[0]
    assert "train.global_batch_tokens 8192 instead of 4096" in note[0]
    assert "- recipes differ: w2" in md
    assert [t["scaling efficiency (%)"] for t in _table(md)] == ["100.0", "90.0"]  # still reported


def test_scaling_world_size_changed(tmp_path):
    # Steps 10-50 on 2 ranks, 60-100 on 4 (a resume on more ranks): reported over the 4-rank steps.
    dev = [50.0, 60.0, 60.0, 60.0, 60.0, 7.0, 40.0, 44.0, 42.0, 41.0]
    run = _tb_run(tmp_path, "mixed", 0, tags={
        "throughput/device/tokens_per_sec": dev,
        "throughput/tokens_per_sec": [d * (2 if i < 5 else 4) for i, d in enumerate(dev)],
        "throughput/step_time_s": [1.0] * 10})
    report = scaling_report([run], tmp_path / "out")
    r = report["runs"][0]
    assert (r["world_size"], r["steps_logged"], r["steps_used"]) == (4, 5, 3)
    assert r["tokens_per_sec_device"] == 42.0 and r["efficiency"] == 1.0
    assert any("ran on 2, 4 ranks; reported over the steps on 4 ranks" in n for n in report["notes"])


def test_scaling_leaves_out_the_first_step_after_a_resume(tmp_path):
    """A resumed attempt warms up again (compilation, caches): its first logged step is left out as the run's
    first ones are. Here step 60, the first after a resume from step 50, took 5x as long."""
    times = [1.0] * 10
    times[5] = 5.0
    run = _tb_run(tmp_path, "resumed", 0, tags={"throughput/device/tokens_per_sec": [100.0 / t for t in times],
                                                "throughput/tokens_per_sec": [100.0 / t for t in times],
                                                "throughput/step_time_s": times})
    _jsonl(run / "attempts.jsonl", [_start(900.0, 1, None), {"event": "end", "time": 950.0, "state": "preempted",
                                                             "step": 50}, _start(960.0, 1, 50)])
    r = scaling_report([run], tmp_path / "out")["runs"][0]
    assert (r["steps_logged"], r["steps_used"], r["first_step_used"]) == (10, 7, 30)
    assert r["step_time_s"] == 1.0 and r["tokens_per_sec"] == 100.0
    (run / "attempts.jsonl").unlink()  # without the record the slow step counts
    assert scaling_report([run], tmp_path / "out2")["runs"][0]["steps_used"] == 8


def test_scaling_warmup_skip():
    assert [warmup_skip(n) for n in (0, 1, 2, 3, 10, 20, 21, 100)] == [0, 0, 1, 2, 2, 2, 3, 10]


def test_scaling_errors(tmp_path):
    with pytest.raises(ReportError, match="at least one run directory"):
        scaling_report([], tmp_path / "out")
    with pytest.raises(ReportError, match=r"run directory .*missing does not exist"):
        scaling_report([tmp_path / "missing"], tmp_path / "out")
    bare = tmp_path / "bare"
    _write_recipe(bare, _recipe(bare))
    with pytest.raises(ReportError, match=r"bare has no TensorBoard events .*train with logging.tensorboard: true"):
        scaling_report([bare], tmp_path / "out")
    nosteps = _tb_run(tmp_path, "nosteps", 0, tags={"loss/train": [4.0, 3.0]})
    with pytest.raises(ReportError, match=r"nosteps has TensorBoard events but no logged step"):
        scaling_report([nosteps], tmp_path / "out")
    (tmp_path / "link").symlink_to(bare)
    with pytest.raises(ReportError, match=r"link is given twice \(also as .*bare\); pass each run directory once"):
        scaling_report([bare, tmp_path / "link"], tmp_path / "out")
    with pytest.raises(ReportError, match=r"bare is given twice; pass each"):
        scaling_report([bare, nosteps, bare], tmp_path / "out")
    assert not (tmp_path / "out" / "scaling.md").exists()


def test_scaling_and_status_import_light():
    code = ("import sys, memtrain.launcher.reports; "
            "print(sorted(m for m in ('torch', 'matplotlib', 'tensorboard', 'deepspeed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_scaling_same_folder_names(tmp_path):
    # Runs of one recipe often share a folder name in different places: the table names them by path.
    a = _tb_run(tmp_path / "a", "run", 1)
    b = _tb_run(tmp_path / "b", "run", 2)
    report = scaling_report([b, a], tmp_path / "out")
    assert [r["name"] for r in report["runs"]] == [str(a), str(b)]
    assert [t["run"] for t in _table(Path(report["markdown"]).read_text(encoding="utf-8"))] == [str(a), str(b)]
