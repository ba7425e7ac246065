"""tools/gpu_check.py: the prepared GPU session runs its phases in order within a budget, records each
(ok / failed / timeout / skipped), rewrites its JSON after every phase, kills a phase that overruns
together with its children, and its plan names only scripts, tests and recipes that exist; on an image
without pytest it installs the prepared wheels of what is missing and nothing else."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

from memtrain.config import load_recipe

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


gc = _load("gpu_check", ROOT / "tools" / "gpu_check.py")


@pytest.fixture(autouse=True)
def _own_triton_caches(tmp_path_factory, monkeypatch):
    """main() installs the carried precompiled kernels (.gpu/triton-cache) as the phases' Triton cache: here neither
    this checkout's nor the machine's /tmp one takes part."""
    root = tmp_path_factory.mktemp("triton-caches")
    monkeypatch.setattr(gc, "TRITON_CACHE", root / "carried")
    monkeypatch.setattr(gc, "DEVICE_TRITON_CACHE", root / "device")
    monkeypatch.setattr(gc, "INDUCTOR_CACHE", root / "carried-inductor")  # and Inductor's
    monkeypatch.setattr(gc, "DEVICE_INDUCTOR_CACHE", root / "device-inductor")


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _gone(pid: int, within_s: float = 10.0) -> bool:
    """Whether process ``pid`` ends (or is only a zombie awaiting its reaper) within ``within_s`` seconds."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        except OSError:  # no /proc: ask the kernel
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            state = "?"
        if state in ("Z", "X"):
            return True
        time.sleep(0.2)
    return False


def test_plan_runs_in_order_and_records_every_outcome(tmp_path):
    out = tmp_path / "out"
    seen = (f"import json; d = json.load(open({str(out / 'gpu_check.json')!r})); "
            "print(json.dumps({'seen': [p['name'] for p in d['phases']]}))")
    child = tmp_path / "child.pid"
    # the overrunning phase starts a grandchild that must die with it (its process group is killed)
    overrun = (f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
               f"open({str(child)!r}, 'w').write(str(p.pid)); print('started', flush=True); time.sleep(60)")
    phases = [
        gc.Phase("bench", _py("import json; print('noise'); print(json.dumps({'tokens_per_s': 5.0, 'mfu': 0.1}))"), 30),
        gc.Phase("reads_partial", _py(seen), 30),
        gc.Phase("fails", _py("import sys; print('boom', file=sys.stderr); sys.exit(3)"), 30),
        gc.Phase("overruns", _py(overrun), 2),
        gc.Phase("tests", _py("print('..F'); print('=== 1 failed, 2 passed in 0.12s ===')"), 30, "pytest"),
    ]
    t0 = time.monotonic()
    report = gc.run_plan(phases, out, budget_s=120, min_start_s=1)
    assert time.monotonic() - t0 < 40  # the 60 s sleeps were killed
    by = {r["name"]: r for r in report["phases"]}
    assert [r["name"] for r in report["phases"]] == [p.name for p in phases]
    assert by["bench"]["status"] == "ok" and by["bench"]["results"] == [{"tokens_per_s": 5.0, "mfu": 0.1}]
    assert by["reads_partial"]["results"] == [{"seen": ["bench"]}]  # the file was written after phase 1
    assert by["fails"]["status"] == "failed" and by["fails"]["rc"] == 3 and "boom" in by["fails"]["tail"]
    assert by["overruns"]["status"] == "timeout" and "started" in by["overruns"]["tail"]
    assert _gone(int(child.read_text())), "the overrunning phase's child process outlived the phase"
    assert by["tests"]["summary"] == "1 failed, 2 passed in 0.12s" and by["tests"]["status"] == "ok"
    on_disk = json.loads((out / "gpu_check.json").read_text())
    assert [r["status"] for r in on_disk["phases"]] == ["ok", "ok", "failed", "timeout", "ok"]
    log = (out / "gpu_check.log").read_text()
    assert "===== fails: failed (rc 3" in log and "boom" in log and "noise" in log
    assert "overruns" in gc.phase_line(by["overruns"]) and "1 failed, 2 passed" in gc.phase_line(by["tests"])


def test_budget_clips_the_running_phase_and_skips_the_rest(tmp_path):
    phases = [gc.Phase("long", _py("import time; time.sleep(30)"), 300),
              gc.Phase("never", _py("print('ran')"), 300)]
    report = gc.run_plan(phases, tmp_path, budget_s=3, min_start_s=1)
    first, second = report["phases"]
    assert first["status"] == "timeout" and first["timeout_s"] <= 3 and first["seconds"] < 20
    assert second["status"] == "skipped" and "budget left" in second["reason"]
    assert "skipped" in gc.phase_line(second)


def test_a_capped_phase_stops_inside_its_clipped_timeout_and_gets_its_env(tmp_path):
    """A training phase is told to stop starting steps CAP_MARGIN_S before its timeout -- the budget's clip
    included -- so it prints its JSON instead of being killed; a phase's own env reaches only it."""
    echo = ("import json, os, sys; print(json.dumps({'argv': sys.argv[1:], "
            "'blocking': os.environ.get('CUDA_LAUNCH_BLOCKING')}))")
    phases = [gc.Phase("capped", [*_py(echo), "--steps", "5"], 300, capped=True, env={"CUDA_LAUNCH_BLOCKING": "1"}),
              gc.Phase("plain", _py(echo), 300)]
    report = gc.run_plan(phases, tmp_path, budget_s=100, min_start_s=1)
    capped, plain = (r["results"][0] for r in report["phases"])
    assert capped["argv"][:2] == ["--steps", "5"] and capped["argv"][2] == "--max-seconds"
    assert 100 - gc.CAP_MARGIN_S - 2 <= float(capped["argv"][3]) <= 100 - gc.CAP_MARGIN_S  # clipped to the budget
    assert capped["blocking"] == "1" and plain == {"argv": [], "blocking": os.environ.get("CUDA_LAUNCH_BLOCKING")}
    assert report["phases"][0]["argv"][-2] == "--max-seconds"  # the JSON records the command that ran
    assert report["phases"][0]["env"] == {"CUDA_LAUNCH_BLOCKING": "1"} and "env" not in report["phases"][1]


def test_phase_lines_give_each_benchmarks_key_figures():
    """The closing table (what a time-limited session reads first): a recipe's tokens/s with its profile's
    costliest op; the kernel sweep's variants each with its form, warps, wave and time per chunk; a failed variant
    with its error; the layer benchmark with its profile's costliest op; the host's time with its forward and
    backward."""
    recipe = {"name": "recipe_400m_mag", "status": "ok", "seconds": 97.0, "results": [{
        "kind": "titans", "tokens_per_s": 22273.0, "mfu": 0.053, "peak_memory_gib": 37.3, "loss_first": 10.86,
        "loss_last": 10.46, "loss_all_finite": True, "steps_done": 50, "profile_busy_fraction": 0.94,
        "profile_top": [{"name": "_bwd_kernel", "self_s": 0.38, "count": 17}, {"name": "gemm", "self_s": 0.1,
                                                                               "count": 400}]}]}
    line = gc.phase_line(recipe)
    assert "22,273 tok/s, MFU 0.053" in line and "device busy 0.94, top op _bwd_kernel 0.38 s x17" in line, line
    recipe["results"][0]["busy_of_timed_step"] = 0.96  # a record with its kernel time over a timed step
    assert "device busy 0.96 of a timed step, 0.94 of the profiled one, top op" in gc.phase_line(recipe)
    sweep = {"name": "titans_kernel_tune", "status": "ok", "seconds": 60.0, "results": [
        {"shape": "mag", "N": 64, "kernels": "triton_kernels", "backward": "shipped", "num_warps": 8, "wave": 32,
         "fwd_ms": 2.1, "fwd_bwd_ms": 24.0, "fwd_us_per_chunk": 8.2, "bwd_us_per_chunk": 85.5,
         "max_rel_err_vs_default": 0.0},
        {"shape": "mag", "backward": "split", "num_warps": None, "wave": 0, "error": "OutOfResources: shared"}]}
    line = gc.phase_line(sweep)
    assert "mag triton_kernels shipped w8 wave 32/64: fwd 8.2 / bwd 85.5 us per chunk, err 0" in line, line
    assert "mag split wNone wave 0: OutOfResources: shared" in line, line
    layer = {"name": "titans_layer", "status": "ok", "seconds": 50.0, "results": [{
        "seq_len": 2048, "dim": 512, "depth": 2, "chunk_size": 64, "kernel_bf16_tokens_per_s": 440513.0,
        "kernel_max_rel_err_vs_torch": 0.002, "chunked_tokens_per_s": 59690.0, "kernel_bf16_weights_tokens_per_s": 5e5,
        "kernel_profile_top": [{"name": "_bwd_kernel", "self_s": 0.012, "count": 1}]}]}
    assert gc.phase_line(layer).endswith("bf16 weights 500,000 tok/s, torch 59,690, top op _bwd_kernel 0.012 s x1"), \
        gc.phase_line(layer)
    del recipe["results"][0]["profile_top"]
    assert "top op" not in gc.phase_line(recipe)
    host = {"name": "host_time", "status": "ok", "seconds": 20.0, "results": [{
        "ops_total": 5265, "host_ms_per_micro_batch": 262.0, "host_forward_ms": 121.0, "host_backward_ms": 141.0,
        "host_us_per_op": 49.76}]}
    assert "5265 ops per micro-batch, host 262 ms (fwd/bwd 121/141 ms, 49.8 us per op)" in gc.phase_line(host), \
        gc.phase_line(host)


def test_a_failed_guard_phase_sets_its_environment_for_the_later_phases(tmp_path):
    """A phase with ``on_failure_env`` that fails (here: exits 1) sets those variables for every phase after it,
    and its record says so; one that passes sets nothing."""
    show = _py("import os, json; print(json.dumps({'v': os.environ.get('MEMTRAIN_GUARD_PROBE')}))")
    for code, want in (("raise SystemExit(1)", "0"), ("pass", None)):
        phases = [gc.Phase("guard", _py(code), 30, on_failure_env={"MEMTRAIN_GUARD_PROBE": "0"}),
                  gc.Phase("after", show, 30), gc.Phase("later", show, 30)]
        report = gc.run_plan(phases, tmp_path / str(want), 60, env={k: v for k, v in os.environ.items()
                                                                     if k != "MEMTRAIN_GUARD_PROBE"})
        guard, after, later = report["phases"]
        assert guard["status"] == ("failed" if want else "ok")
        assert guard.get("set_for_later_phases") == ({"MEMTRAIN_GUARD_PROBE": "0"} if want else None)
        assert after["results"] == later["results"] == [{"v": want}]


def test_main_exit_status_and_unknown_phase(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gc, "PLAN", [gc.Phase("a_one", _py("print('{\"x\": 1}')"), 30),
                                     gc.Phase("b_two", _py("import sys; sys.exit(1)"), 30)])
    assert gc.main(["--out", str(tmp_path), "--phases", "a_"]) == 0
    assert "a_one" in capsys.readouterr().out
    assert gc.main(["--out", str(tmp_path)]) == 1  # b_two failed
    with pytest.raises(SystemExit, match="no phase named zzz; the phases are a_one, b_two"):
        gc.main(["--out", str(tmp_path), "--phases", "zzz"])
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit, match=r"cannot create --out .*file/sub: .*; pass a writable folder"):
        gc.main(["--out", str(tmp_path / "file" / "sub")])


def test_a_phase_that_finishes_takes_its_leftover_children_with_it(tmp_path):
    """A phase that exits while a child it started still runs (a stuck worker): the child is killed."""
    pid_file = tmp_path / "pid"
    code = (f"import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid))")
    report = gc.run_plan([gc.Phase("leaves_a_child", _py(code), 30)], tmp_path / "out", budget_s=60, min_start_s=1)
    assert report["phases"][0]["status"] == "ok"
    assert _gone(int(pid_file.read_text())), "the finished phase's child process outlived it"


def test_host_time_twin_keeps_the_recipes_structure():
    """The host_time phase times titans-170m-mac's structure at tiny widths: the same blocks, memory depth and chunk,
    and as many MAC segments, each as many chunks long relative to its memory chunk as one (the op count depends
    on these, not on widths; test_op_count_counts_the_structure_not_the_widths)."""
    full = load_recipe(str(ROOT / "recipes" / "titans-170m-mac.yaml"))
    twin = load_recipe(str(ROOT / "recipes" / "titans-170m-mac.yaml"), list(gc.HOST_TWIN))
    phase = gc.select(gc.PLAN, "host_time")[0]
    assert phase.argv[1:3] == ["benchmarks/op_count.py", "recipes/titans-170m-mac.yaml"] and "--time" in phase.argv
    assert twin.model.n_layers == full.model.n_layers
    assert twin.model.titans.memory_depth == full.model.titans.memory_depth
    assert twin.data.seq_len // twin.model.titans.segment_len == full.data.seq_len // full.model.titans.segment_len
    assert twin.model.titans.segment_len == twin.model.titans.memory_chunk_size == full.model.titans.memory_chunk_size
    assert twin.model.titans.variant == "mac" and twin.model.titans.kernel == "triton"


def test_pytest_summary_forms():
    assert gc.pytest_summary("x\n2 passed, 1 skipped in 3.21s\n") == "2 passed, 1 skipped in 3.21s"
    assert gc.pytest_summary("== 1 failed, 9 passed, 3 deselected in 61.00s (0:01:01) ==") == \
        "1 failed, 9 passed, 3 deselected in 61.00s (0:01:01)"
    assert gc.pytest_summary("Traceback ...\nImportError: x") is None


def test_the_real_plan_names_existing_files_and_loadable_recipes(capsys):
    assert gc.missing_paths(gc.PLAN) == []
    assert gc.main(["--list"]) == 0
    assert "recipe_400m_mag" in capsys.readouterr().out
    names = [p.name for p in gc.PLAN]
    assert len(set(names)) == len(names)
    assert all(p.capped for p in gc.PLAN if "benchmarks/train_throughput.py" in p.argv)  # they report, not die
    assert all(f"recipe_{r.removeprefix('titans-').replace('-', '_')}" in names for r in gc.TITANS_RECIPES)
    for p in gc.PLAN:
        if "benchmarks/train_throughput.py" in p.argv:
            i = p.argv.index("benchmarks/train_throughput.py")
            recipe, rest = p.argv[i + 1], p.argv[i + 2:]
            overrides = [a for a in rest[: next((j for j, a in enumerate(rest) if a.startswith("--")), len(rest))]]
            r = load_recipe(str(ROOT / recipe), overrides)  # a stale key or recipe fails here
            if recipe.startswith("recipes/titans-"):
                assert r.model.type == "titans" and r.steps(r.train.schedule.warmup) == 2
        if "benchmarks/titans.py" in p.argv:
            bench = _load("titans_bench", ROOT / "benchmarks" / "titans.py")
            idx = [int(i) for i in p.argv[p.argv.index("--configs") + 1].split(",")]
            assert max(idx) < len(bench.FULL)
    assert gc.select(gc.PLAN, "recipe_")[0].name == "recipe_170m_mac"
    # 15 device minutes: the guards (the fused kernels, which every recipe runs; MAC's fused retrieval and grouped
    # weight gradients), the two recipes with a throughput target as they ship, the split loops pipelined against
    # unpipelined (the scan kernels alone, from the cache: cheap), MAC's old backward beside them, the layer target,
    # the other two recipes, MAC with its loops pipelined
    assert names[:14] == ["env", "fused_kernels", "fused_conv", "fused_read", "grouped_wgrad", "recipe_170m_mac",
                          "recipe_400m_mag", "titans_kernel_pipelined", "recipe_170m_mac_shipped", "titans_layer",
                          "recipe_340m_mac", "recipe_760m_mal", "recipe_170m_mac_pipelined", "recipe_170m_mac_compiled"]
    from memtrain.kernels.titans import STAGES_ENV
    from memtrain.kernels.titans import triton_kernels as tk

    quick = gc.select(gc.PLAN, "titans_kernel_pipelined")[0]
    assert quick.argv[-2:] == ["--forms", "split,pipelined"] and not quick.env
    assert gc.select(gc.PLAN, "recipe_170m_mac_pipelined")[0].env == {STAGES_ENV: "2"}
    # the recipes' chunk of 16: both pipelined loops of the split backward take the 2 stages
    assert [tk.loop_stages(k, 64, 128, 16, 2) for k in ("bwd_recompute", "bwd_carry")] == [2, 2]
    from memtrain.kernels.titans import form_env

    old, new = gc.select(gc.PLAN, "recipe_170m_mac_shipped")[0], gc.select(gc.PLAN, "recipe_170m_mac")[0]
    assert old.env == form_env("shipped") and old.argv[:4] == new.argv[:4] and not new.env, (old.argv, new.argv)
    assert "--waves" not in gc.select(gc.PLAN, "titans_kernel_tune")[0].argv  # measured: waves only lose
    # the first recipe compiles flex attention and the fused kernels in its first step (52 s for 400m-mag, H200)
    assert gc.select(gc.PLAN, "recipe_170m_mac")[0].timeout_s >= 120
    guard = gc.select(gc.PLAN, "fused_kernels")[0]
    from memtrain.model.anchor import FUSED_ROPE_ENV
    from memtrain.model.titans.memory import FUSED_CONV_ENV, FUSED_OUTPUT_ENV, FUSED_PROLOGUE_ENV, FUSED_READ_ENV

    assert guard.on_failure_env == {FUSED_PROLOGUE_ENV: "0", FUSED_OUTPUT_ENV: "0", FUSED_ROPE_ENV: "0"}
    assert "tests/test_titans_kernel.py" in guard.argv and "tests/test_rope_kernel.py" in guard.argv
    read_guard = gc.select(gc.PLAN, "fused_read")[0]  # its own: a failure turns off the retrieval alone
    assert read_guard.on_failure_env == {FUSED_READ_ENV: "0"} and gc.PLAN.index(read_guard) < gc.PLAN.index(
        gc.select(gc.PLAN, "recipe_170m_mac")[0])
    conv_guard = gc.select(gc.PLAN, "fused_conv")[0]  # the convolution's fusion alone; its tests not in the first
    assert conv_guard.on_failure_env == {FUSED_CONV_ENV: "0"} and "not conv_" in guard.argv[-1]
    assert "conv_" in conv_guard.argv[-1]
    from memtrain.model.grouped_linear import GROUPED_ENV

    grouped = gc.select(gc.PLAN, "grouped_wgrad")[0]
    assert grouped.on_failure_env == {GROUPED_ENV: "0"} and "tests/test_gpu.py" in grouped.argv
    assert gc.select(gc.PLAN, "recipe_170m_mac_ungrouped")[0].env == {GROUPED_ENV: "0"}
    assert "CUDA_LAUNCH_BLOCKING" not in gc.select(gc.PLAN, "recipe_170m_mac_compiled")[0].env
    # titans-340m-mac is measured at micro-batch 8, its candidate (16 memory heads: 128 scan programs), and says so
    mac340 = gc.select(gc.PLAN, "recipe_340m_mac")[0]
    assert "train.micro_batch_size=8" in mac340.argv and "8 sequences, not the recipe's" in mac340.about
    assert "not the recipe's" not in gc.select(gc.PLAN, "recipe_760m_mal")[0].about


def test_layer_benchmark_builds_the_recipes_memory_whose_inner_loop_stays_finite():
    """benchmarks/titans.py times the layer as the Titans recipes build it. Its first GPU run built it with
    NeuralMemory's paper defaults, whose inner loop diverged at the target configuration (chunk 64), so its error
    column came out NaN: here, at that configuration (one sequence of 2,048 tokens, the PyTorch form on CPU), the
    output and every end-state tensor stay finite and small."""
    from memtrain.config import TitansConfig

    bench = _load("titans_bench", ROOT / "benchmarks" / "titans.py")
    _, T, dim, H, depth, C = bench.FULL[0]
    mem = bench.make_memory(dim, H, depth, C)
    t = TitansConfig()
    assert (mem.max_lr, mem.max_momentum, mem.value_norm) == (t.memory_max_lr, t.memory_max_momentum,
                                                            t.memory_value_norm)
    mem.kernel = "torch"
    torch.manual_seed(0)
    with torch.no_grad():
        y, state = mem(torch.randn(1, T, dim))[:2]
    assert torch.isfinite(y).all() and y.abs().max() < 10
    tensors = [*state.weights, *state.momentum]
    assert len(tensors) == 2 * depth and all(torch.isfinite(x).all() and x.abs().max() < 100 for x in tensors)


def test_env_phase_prints_one_json_line():
    import subprocess

    r = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--env"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    assert rec["torch"] and "device" in rec and "nvidia_smi" in rec


def test_kernel_launch_sweep_benchmark_under_the_interpreter():
    """benchmarks/titans_kernels.py (the plan's titans_kernel_tune) at its tiny CPU shape: one JSON line per
    num_warps variant, for the lean, split and pipelined forms of the backward (``backward``; ``stages``: the split
    loops' pipelining, 2 in the pipelined form), for the shipped launch in waves
    of 8 of its 9 programs (``wave``: the same result bit for bit) and for the any-depth kernels at that depth, the
    default marked, every variant computing what the default does. ``--static`` (compiled for sm_90, not run): the
    same rows but the waves (no binary of their own) with ptxas's registers, spills and shared memory."""
    import os
    import subprocess

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "titans_kernels.py"), "--interpret", "--shapes",
                        "layer", "--warps", "4,8", "--waves", "8,16"], capture_output=True, text=True, timeout=300,
                       env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [(row["kernels"], row["num_warps"], row["backward"], row["wave"], row["default"]) for row in rows] == [
        ("triton_kernels", 4, "shipped", 9, True), ("triton_kernels", 4, "lean", 9, False),
        ("triton_kernels", 4, "split", 9, False), ("triton_kernels", 4, "pipelined", 9, False),
        ("triton_kernels", 4, "shipped", 8, False), ("triton_kernels", 8, "shipped", 9, False),
        ("triton_deep", 4, "shipped", 9, False)]
    assert [row["launches"] for row in rows] == [1, 1, 1, 1, 2, 1, 1]
    assert [row["stages"] for row in rows] == [1, 1, 1, 2, 1, 1, 1]
    assert [row["forward"] for row in rows[:4]] == ["shipped", "shipped", "split", "split"]
    assert rows[4]["max_rel_err_vs_default"] == 0.0  # the same programs in two launches
    for args, why in ((["--waves", "12"], "--waves '12': expected positive multiples of 8"),
                      (["--forms", "split,fast"], "--forms 'split,fast': expected forms of shipped, lean, split, "
                                                  "pipelined")):
        bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "titans_kernels.py"), "--interpret", *args],
                             capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
        assert bad.returncode == 2 and why in bad.stderr.splitlines()[-1], bad.stderr
    bench = _load("titans_kernels_forms", ROOT / "benchmarks" / "titans_kernels.py")  # --forms: those alone
    assert bench.variants("layer", [4, 8], bench.TINY, (8,), ("split", "pipelined")) == [
        (None, False, "split", 0), (None, False, "pipelined", 0)]
    assert bench.variants("deep", [8], bench.TINY, (), ("split",)) == []
    # --static: the shipped launch and the any-depth kernels (--warps 4 is the tiny shape's default: no third row)
    for row in rows:
        # the split backward forms the chain through the per-token gradients in two parts (the chunk's own and the
        # carried), each rounded to bf16 for the tensor cores, where the others round their sum once: it differs
        # from them by bf16 rounding (2^-8 per operand), not float32's (in float32 all three equal float64's
        # scan below 1e-4: tests/test_titans_kernel.py)
        tol = 4e-3 if row["backward"] in ("split", "pipelined") else 1e-6
        assert row["shape"] == "layer" and row["fwd_bwd_ms"] > 0 and row["max_rel_err_vs_default"] < tol, row
        # per chunk of every program: the tiny shape's 7 tokens are 2 chunks of 4
        assert abs(row["fwd_us_per_chunk"] * 2 - row["fwd_ms"] * 1e3) < 1, row
        assert abs(row["bwd_us_per_chunk"] * 2 - (row["fwd_bwd_ms"] - row["fwd_ms"]) * 1e3) < 1, row
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "titans_kernels.py"), "--static", "--tiny",
                        "--shapes", "layer", "--warps", "4"], capture_output=True, text=True, timeout=300, env=env,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [(row["kernels"], row["num_warps"], row["backward"], row["default"]) for row in rows] == [
        ("triton_kernels", 4, "shipped", True), ("triton_kernels", 4, "lean", False),
        ("triton_kernels", 4, "split", False), ("triton_kernels", 4, "pipelined", False),
        ("triton_deep", 4, "shipped", False)]
    # the pipelined form's loops compiled in 2 stages, its per-chunk kernels as the split form's
    assert [rows[3][f"{k}_num_stages"] for k in ("fwd_advance", "fwd_read", "bwd_recompute", "bwd_local",
                                                  "bwd_carry")] == [2, 1, 2, 1, 2], rows[3]
    assert [rows[2][f"{k}_num_stages"] for k in ("fwd_advance", "bwd_recompute", "bwd_carry")] == [1, 1, 1], rows[2]
    assert rows[3]["bwd_carry_shared"] > rows[2]["bwd_carry_shared"], (rows[2], rows[3])
    for row in rows:
        split = row["backward"] in ("split", "pipelined")
        assert row["forward"] == ("split" if split else "shipped"), row
        for kernel in (("fwd_advance", "fwd_read", "bwd_recompute", "bwd_local", "bwd_carry") if split else
                       ("fwd", "bwd")):
            assert 0 < row[f"{kernel}_registers"] <= 255 and row[f"{kernel}_spill_stores"] >= 0, row
            assert 0 < row[f"{kernel}_shared"] <= 232448, row
            assert row[f"{kernel}_program"] is None or row[f"{kernel}_program"]["instructions"] > 0, row
            assert row[f"{kernel}_stack_frame"] is None or row[f"{kernel}_frame_kib_per_program"] == round(
                row[f"{kernel}_stack_frame"] * 32 * row["num_warps"] / 1024, 1), row
        if split and row["bwd_local_loops"] is not None:  # one chunk per program: no loop; the others loop
            assert [len(row[f"bwd_{part}_loops"]) for part in ("recompute", "local", "carry")] == [1, 0, 1], row
            assert [len(row[f"fwd_{part}_loops"]) for part in ("advance", "read")] == [1, 0], row


def test_kernel_sweep_records_the_launched_kernels_loops(monkeypatch):
    """On a GPU, benchmarks/titans_kernels.py reads each timed kernel's registers, spills and innermost loops from
    the binary the device's Triton launched (``device_caches``), so each timing sits beside the spill traffic of
    that binary: ``local_kib_per_program`` is a loop's local bytes per thread times the program's threads (here
    24 bytes x 8 warps x 32 = 6 KiB); ``program`` counts the whole kernel (a kernel without loops, as the split
    backward's chunk-local part, runs it once per program); ``stack_frame`` is cuobjdump's, per thread, and
    ``frame_kib_per_program`` times the threads. A kernel without a cubin or nvdisasm gives no ``loops``, not an
    error."""
    from types import SimpleNamespace

    from memtrain.kernels.titans import aot

    tk = _load("titans_kernels_bench", ROOT / "benchmarks" / "titans_kernels.py")
    seen = []
    sass = """
.L_x_0:
        /*0000*/                   LDL.128 R4, [R1+0x10] ;
        /*0010*/                   STL.64 [R1+0x20], R8 ;
        /*0020*/                   HMMA.16816.F32.BF16 R16, R12, R8, R16 ;
        /*0030*/              @!P0 BRA `(.L_x_0) ;
        /*0040*/                   EXIT ;
"""

    def disassemble(cubin):
        seen.append(cubin)
        return sass

    monkeypatch.setattr(aot, "_sass", disassemble)
    monkeypatch.setattr(aot, "_res_usage", lambda cubin: f"Function _bwd_kernel:\n  REG:255 STACK:{len(cubin)} "
                                                         "SHARED:0 LOCAL:0")
    kernel = SimpleNamespace(asm={"cubin": b"cubin"}, n_regs=255, n_spills=64,
                             metadata=SimpleNamespace(num_warps=8, shared=61440))
    fn = SimpleNamespace(device_caches={0: ({"key": kernel},)})
    info = tk._compiled_info(fn)
    assert seen == [b"cubin"]
    figures = {"local_loads": 1, "local_stores": 1, "local_bytes": 24, "shared": 0, "barriers": 0, "mma": 1,
               "local_kib_per_program": 6.0}
    assert info == {"n_regs": 255, "n_spills": 64, "shared": 61440,
                    "loops": [{"instructions": 4, **figures}], "program": {"instructions": 5, **figures},
                    "stack_frame": 5, "frame_kib_per_program": 1.2}  # 5 bytes x 256 threads
    assert tk._compiled_info(SimpleNamespace(device_caches={0: ({"key": SimpleNamespace(
        asm={}, n_regs=1, n_spills=0, metadata=SimpleNamespace(num_warps=4, shared=0))},)})) == {
        "n_regs": 1, "n_spills": 0, "shared": 0}


def _op_count(*overrides: str) -> dict:
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "op_count.py"), "recipes/titans-cpu-mac.yaml",
                        "model.titans.kernel=triton", *overrides], capture_output=True, text=True, timeout=300,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_op_count_counts_the_structure_not_the_widths():
    """benchmarks/op_count.py on titans-cpu-mac (4 blocks, 4 MAC segments of 32 tokens): one forward launch of the scan
    and three of its split backward, one forward and one backward launch of the coefficients and of the
    prologue's two kernels per block and segment (and the sum of the convolution's weight gradients, fused into
    the q/k/v kernels, which run once more per block for the retrieval queries), and the output stage's and
    RoPE's (counted as launches, not once more as the custom operators around them), and the same op counts at
    two widths -- the count depends on layers and segments, so small widths give a paper recipe's count."""
    a = _op_count()
    launches = dict(a["triton_launches"])
    # RoPE (memtrain.kernels.rope), forward and backward: per block the queries, the segments' own keys, and each
    # segment's retrieved keys
    assert launches.pop("_rope_kernel") == 2 * 4 * (2 + 4), a["triton_launches"]
    # the memory's output stage (memtrain.kernels.titans.output): per block each segment's read and the writes'
    # outputs after the loop
    assert (launches.pop("_out_fwd_kernel"), launches.pop("_out_bwd_kernel")) == (4 * 5, 4 * 5), a["triton_launches"]
    # the scan's backward in its default form, split (triton_kernels.SPLIT_BACKWARD): each call's one recompute
    # group (two chunks of 16) in three launches, the group's states, the chunks' own part, the carried part; each
    # segment's retrieval one launch each way (memtrain.kernels.titans.read); the q/k/v kernels (with the convolution
    # and its weight gradients' sum) per write and once more per block for the retrieval queries
    assert {k: launches.pop(f"_{k}_kernel") for k in ("qkv_fwd", "qkv_bwd", "conv_grad")} == dict.fromkeys(
        ("qkv_fwd", "qkv_bwd", "conv_grad"), 4 * 5), a["triton_launches"]
    assert launches == {f"_{k}_kernel": 16 for k in ("fwd", "bwd_recompute", "bwd_local", "bwd_carry", "coef_fwd",
                                                     "coef_bwd", "gates_fwd", "gates_bwd", "read_fwd", "read_bwd")}
    assert not [op for op, _ in a["top_ops"] if op.startswith("titans_")], a["top_ops"]
    assert a["ops_forward"] > 0 and a["ops_backward"] > 0
    assert a["ops_total"] == a["ops_forward"] + a["ops_backward"]
    assert a["ops_per_token"] == round(a["ops_total"] / (16 * 128), 3)
    by_module = a["forward_by_module"]
    assert by_module["PrefixAttention.attend_heads"] > 0
    # the retrievals: their kernels alone, but for the first segment's initial weights, cast to the inner dtype
    assert by_module["NeuralMemory.read"] == 4 * 2, by_module
    # the gates are the gate projection (MAC: stacked with to_qkv, counted under NeuralMemory.write) and one fused
    # launch that reads its columns where they lie: no op of their own
    assert "NeuralMemory._gates" not in by_module, by_module
    b = _op_count("model.d_model=64", "model.ffn_dim=96")
    counts = ("ops_forward", "ops_backward")
    assert {k: b[k] for k in counts} == {k: a[k] for k in counts}
    c = _op_count("model.n_layers=2")
    assert c["triton_launches"]["_fwd_kernel"] == 8 and c["ops_total"] < a["ops_total"]


def test_op_count_times_the_host_without_changing_the_counts():
    """``--time K`` times K more forwards and backwards with nothing counted and reports their median (and per op,
    and the forward's and the backward's apart);
    the counts are those of a run without it (the timed steps' stubbed launches are not added to them), and a negative
    K is refused in one line."""
    a = _op_count()
    t = _op_count("--time", "2")
    for key in ("ops_forward", "ops_backward", "ops_total", "triton_launches", "top_ops", "forward_by_module"):
        assert t[key] == a[key], key
    assert "host_ms_per_micro_batch" not in a
    assert len(t["host_ms_all"]) == 2 and 0 < min(t["host_ms_all"]) <= t["host_ms_per_micro_batch"] <= max(
        t["host_ms_all"]) + 0.01
    assert t["host_us_per_op"] == round(t["host_ms_per_micro_batch"] * 1e3 / t["ops_total"], 2)
    # the forward and the backward apart (medians of each part): both timed, each below the whole's slowest step,
    # and the two medians within rounding of the whole's when K = 2 (a median of two is their mean)
    assert 0 < t["host_forward_ms"] < max(t["host_ms_all"]) and 0 < t["host_backward_ms"] < max(t["host_ms_all"])
    assert abs(t["host_forward_ms"] + t["host_backward_ms"] - t["host_ms_per_micro_batch"]) < 0.05
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "op_count.py"), "recipes/titans-cpu-mac.yaml",
                        "--time", "-1"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 2 and "--time takes a count" in r.stderr.strip().splitlines()[-1], r.stderr


def test_op_count_counts_rms_norm_as_cuda_runs_it():
    """``F.rms_norm`` is one fused kernel each way on CUDA (torch 2.11+) where input and gain share a dtype or there is
    no gain, and its formula where they differ: op_count counts it so (one ``_fused_rms_norm`` forward, one
    ``_fused_rms_norm_backward``), with the same values and gradients as ``F.rms_norm`` itself."""
    import torch
    import torch.nn.functional as F

    oc = _load("op_count", ROOT / "benchmarks" / "op_count.py")
    torch.manual_seed(0)
    for weighted in (True, False):
        x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
        w = torch.randn(8, dtype=torch.float64, requires_grad=True) if weighted else None
        gy = torch.randn(3, 5, 8, dtype=torch.float64)
        ref = F.rms_norm(x, (8,), w, 1e-6)
        ref_grads = torch.autograd.grad(ref, [x, w] if weighted else [x], gy)
        counter = oc._Counter(["here"])
        with oc.rms_norm_fused(counter), counter:
            y = F.rms_norm(x, (8,), w, 1e-6)
            forward = dict(counter.ops)
            grads = torch.autograd.grad(y, [x, w] if weighted else [x], gy)
        assert forward == {"_fused_rms_norm": 1}, forward
        assert dict(counter.ops) == {"_fused_rms_norm": 1, "_fused_rms_norm_backward": 1}, counter.ops
        assert counter.by_module == {"here": 2}
        torch.testing.assert_close(y, ref, rtol=0, atol=0)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, rtol=0, atol=0)
    # mixed dtypes: CUDA's composite fallback, its formula counted op by op
    counter = oc._Counter(["here"])
    with oc.rms_norm_fused(counter), counter, pytest.warns(UserWarning, match="Cannot dispatch to fused"):
        F.rms_norm(torch.randn(2, 8), (8,), torch.ones(8, dtype=torch.float64))
    assert "_fused_rms_norm" not in counter.ops and sum(counter.ops.values()) > 3, counter.ops
    # outside the context F.rms_norm is torch's again: nothing is counted as fused
    counter = oc._Counter(["here"])
    with counter:
        F.rms_norm(torch.randn(2, 8), (8,))
    assert "_fused_rms_norm" not in counter.ops and sum(counter.ops.values()) > 3, counter.ops


def test_test_tools_are_installed_only_where_missing(tmp_path, monkeypatch):
    """On a GPU image without pytest, the wheels of --prepare are installed for the phases, and nothing the
    interpreter already has is shadowed; here pytest exists, so a stand-in module plays the missing one."""
    env = {"PYTHONPATH": "/somewhere"}
    assert gc.ensure_test_tools(env, extra=tmp_path / "none") == "pytest present" and env == {"PYTHONPATH": "/somewhere"}
    extra = tmp_path / "extra"
    extra.mkdir()
    wheel = extra / "memtrain_gpu_check_probe-1.0-py3-none-any.whl"
    import zipfile

    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("memtrain_gpu_check_probe/__init__.py", "VALUE = 7\n")
        info = "memtrain_gpu_check_probe-1.0.dist-info/"
        z.writestr(info + "METADATA", "Metadata-Version: 2.1\nName: memtrain-gpu-check-probe\nVersion: 1.0\n")
        z.writestr(info + "WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(info + "RECORD", "")
    # a wheel of something present (pytest itself) must not be installed over it
    (extra / "pytest-0.0.0-py3-none-any.whl").write_bytes(b"not a wheel")
    site = tmp_path / "site"
    done = gc.ensure_test_tools(env, extra=extra, site=site)
    assert done == f"installed memtrain_gpu_check_probe into {site}", done
    assert env["PYTHONPATH"] == f"{site}{os.pathsep}/somewhere"
    assert (site / "memtrain_gpu_check_probe" / "__init__.py").exists() and not (site / "pytest").exists()
    r = subprocess.run([sys.executable, "-c", "import memtrain_gpu_check_probe as m; print(m.VALUE)"],
                       capture_output=True, text=True, env={**os.environ, **env})
    assert r.stdout.strip() == "7", r.stderr


def test_prepare_pins_the_constraints_versions():
    pins = gc._pins()
    assert [p.split("==")[0] for p in pins] == ["pytest", "pytest-timeout"] and all("==" in p for p in pins)


def test_train_throughput_stops_at_its_time_cap_and_profiles_a_step():
    """benchmarks/train_throughput.py, as the GPU check's training phases run it: with ``--max-seconds`` it stops
    starting steps at the cap and still prints its JSON (``steps_done`` below ``--steps``), prints one progress
    line per step on stderr, and ``--profile K`` adds one profiled step (busy fraction, the top K ops) and its
    device time over the timed steps' median (``busy_of_timed_step``)."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_throughput.py"), "recipes/quickstart.yaml",
                        "--steps", "200", "--warmup", "1", "--max-seconds", "3", "--profile", "3"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    row = json.loads(r.stdout.strip().splitlines()[-1])
    assert 1 <= row["steps_done"] < 200 and len(row["step_s_all"]) == row["steps_done"]
    assert row["loss_all_finite"] and row["tokens_per_s"] > 0
    progress = [line for line in r.stderr.splitlines() if line.startswith("memtrain step ")]
    assert len(progress) == row["steps_done"] + 1 and "(warm-up)" in progress[0]
    assert 0 < row["profile_busy_fraction"] <= 1.5 and row["profile_step_s"] > 0
    assert row["busy_of_timed_step"] == pytest.approx(row["profile_device_busy_s"] / row["step_s"], rel=1e-3)
    assert len(row["profile_top"]) == 3 and all(t["self_s"] > 0 and t["count"] >= 1 for t in row["profile_top"])
    for part in ("forward", "backward", "optimizer"):  # on CPU nothing is waited for: the host's time is the part's
        assert row[f"host_{part}_s"] == pytest.approx(row[f"{part}_s"], rel=1e-2, abs=1e-4), part
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_throughput.py"), "recipes/quickstart.yaml",
                          "--max-seconds", "0"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert bad.returncode == 2 and "--max-seconds must be > 0" in bad.stderr


def test_step_clock_splits_the_hosts_time_from_the_devices(monkeypatch):
    """``StepClock`` on a GPU with ``sync``: a part's time runs until the device is done, its ``host`` time until its
    Python code returned (before the wait), summed over micro-batches; without ``sync`` nothing waits and the two are
    the same."""
    import time

    import torch

    from memtrain.launcher.train import StepClock

    waits = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: (waits.append(device), time.sleep(0.05)))
    cuda = torch.device("cuda")
    clock = StepClock(cuda, sync=True)
    for _ in range(2):
        clock.start()
        time.sleep(0.02)  # the host's part
        clock.mark("forward")
    assert len(waits) == 4 and waits[0] == cuda
    assert 0.04 <= clock.host["forward"] < 0.09, clock.host
    assert clock.seconds["forward"] >= clock.host["forward"] + 2 * 0.05, clock.seconds
    assert clock.host["backward"] == clock.seconds["backward"] == 0.0
    unsynced = StepClock(cuda, sync=False)
    unsynced.start()
    time.sleep(0.01)
    unsynced.mark("backward")
    assert len(waits) == 4
    assert unsynced.host["backward"] == pytest.approx(unsynced.seconds["backward"], abs=1e-3)


def _entry(cache: Path, key: str, name: str, size: int = 5) -> None:
    d = cache / key
    d.mkdir(parents=True)
    (d / f"{name}.json").write_text(json.dumps({"name": name}))
    (d / f"{name}.cubin").write_bytes(b"c" * size)
    (d / f"{name}.ptx").write_text("ptx")  # kept where Triton put it, not brought back
    grp = {"child_paths": {f"{name}.json": str(d / f"{name}.json"), f"{name}.cubin": str(d / f"{name}.cubin")}}
    (d / f"__grp__{name}.json").write_text(json.dumps(grp))


def test_main_runs_the_phases_on_the_precompiled_triton_cache_and_brings_back_what_they_compiled(tmp_path,
                                                                                                 monkeypatch):
    """The carried kernels are installed as the phases' TRITON_CACHE_DIR; the report says how many, whether the
    device's Triton and compiler parts of the cache keys (the env phase's) are those they were made with, which
    kernels the phases compiled after all, and those come back in OUT/triton-cache (metadata, binary and group,
    smallest first within the limit)."""
    _entry(gc.TRITON_CACHE, "AAA", "_fwd_kernel")
    (gc.TRITON_CACHE / "precompiled.json").write_text(json.dumps({"triton": "3.6.0", "triton_key": "k1",
                                                                  "backend": "ptxas 12.8-90"}))
    compile_two = ("import os, json, pathlib\n"
                   "root = pathlib.Path(os.environ['TRITON_CACHE_DIR'])\n"
                   "for key, name, size in (('NEW1', 'triton_poi_fused_0', 10), ('NEW2', 'big_kernel', 10**6)):\n"
                   "    d = root / key; d.mkdir()\n"
                   "    (d / f'{name}.json').write_text('{}'); (d / f'{name}.cubin').write_bytes(b'x' * size)\n"
                   "    (d / f'{name}.llir').write_text('ir')\n"
                   "    (d / f'__grp__{name}.json').write_text(json.dumps({'child_paths': {}}))\n")
    monkeypatch.setattr(gc, "PLAN", [
        gc.Phase("env", _py('print(\'{"device": "d", "torch": "t", "triton_key": "k1", '
                            '"triton_backend": "ptxas 13.0-90"}\')'), 30),
        gc.Phase("compiles", _py(compile_two), 30)])
    monkeypatch.setattr(gc, "RETURNED_CACHE_BYTES", 1000)
    assert gc.main(["--out", str(tmp_path / "out")]) == 0
    cache = json.loads((tmp_path / "out" / "gpu_check.json").read_text())["triton_cache"]
    assert cache["installed"] == 1 and cache["entries"] == ["AAA"] and cache["made_with"]["triton_key"] == "k1"
    assert cache["triton_key_matches"] is True and cache["backend_matches"] is False  # another ptxas there
    assert cache["compiled_on_device"] == ["big_kernel", "triton_poi_fused_0"]
    packed = tmp_path / "out" / "triton-cache.tar.gz"
    assert cache["returned"] == {"saved": 1, "of": 2, "inductor_saved": 0, "inductor_of": 0,
                                 "bytes": cache["returned"]["bytes"], "file": str(packed),
                                 "file_bytes": packed.stat().st_size}
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [  # one file: the device tool returns 8 at most
        "gpu_check.json", "gpu_check.log", "triton-cache.tar.gz"]
    with tarfile.open(packed) as tar:
        assert sorted(tar.getnames()) == ["NEW1/__grp__triton_poi_fused_0.json", "NEW1/triton_poi_fused_0.cubin",
                                          "NEW1/triton_poi_fused_0.json"]


def test_the_returned_kernels_fit_one_file_and_join_the_next_carried_cache(tmp_path):
    """What a GPU run compiled comes back as one gzipped tar within the device tool's file limit (the largest
    entries dropped until it fits), and ``--prepare --device-cache`` installs its entries, with their group files
    pointing at the new place; a missing, non-tar or truncated --device-cache is one argparse line before any
    compiling."""
    src = tmp_path / "device"
    for i, size in enumerate((10, 20, 400_000)):
        _entry(src, f"E{i}", f"kernel_{i}", size)
    (src / "E2" / "kernel_2.cubin").write_bytes(os.urandom(400_000))  # incompressible: over a 100 KB file limit
    out = tmp_path / "out" / "triton-cache.tar.gz"
    back = gc.save_compiled({"entries": []}, out, src=src, limit_bytes=10**7, file_limit_bytes=100_000)
    assert back["saved"] == 2 and back["of"] == 3 and back["file_bytes"] == out.stat().st_size <= 100_000
    dest = tmp_path / "next"
    assert sorted(gc.add_device_cache(out, dest)) == ["E0", "E1"]
    assert sorted(p.name for p in dest.iterdir()) == ["E0", "E1"]
    grp = json.loads((dest / "E1" / "__grp__kernel_1.json").read_text())
    assert grp["child_paths"]["kernel_1.cubin"] == str(dest.resolve() / "E1" / "kernel_1.cubin")
    (tmp_path / "gpu_check.json").write_text("{}")
    (tmp_path / "cut.tar.gz").write_bytes(out.read_bytes()[: out.stat().st_size // 2])  # cut short on its way back
    for bad in ("missing.tar.gz", "gpu_check.json", "cut.tar.gz"):
        run = subprocess.run([sys.executable, "tools/gpu_check.py", "--prepare", "--device-cache", str(tmp_path / bad)],
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert run.returncode == 2 and "not a folder or a whole tar file" in run.stderr.splitlines()[-1], run.stderr


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_inductor_graph_caches_are_installed_for_the_phases_and_what_they_add_comes_back(tmp_path, monkeypatch):
    """The Inductor graph caches carried in .gpu (earlier runs' flex attention and compiled blocks) are the phases'
    TORCHINDUCTOR_CACHE_DIR; of what the phases write there, the graph caches they added (not the installed ones, not
    the generated modules or locks) come back in the same tar, before the Triton kernels, and ``--device-cache``
    adds them to the cache carried next."""
    carried = gc.INDUCTOR_CACHE
    (carried / "fxgraph" / "aa" / "k1").mkdir(parents=True)
    (carried / "fxgraph" / "aa" / "k1" / "e1").write_text("old graph")
    (carried / "locks").mkdir()
    (carried / "locks" / "x.lock").write_text("")  # not a graph cache: not installed
    writes = ("import os, pathlib, sys\n"
              "root = pathlib.Path(os.environ['TORCHINDUCTOR_CACHE_DIR'])\n"
              "if (root / 'fxgraph/aa/k1/e1').read_text() != 'old graph' or (root / 'locks').exists(): sys.exit(3)\n"
              "for rel in ('fxgraph/bb/k2/e2', 'aotautograd/cc/k3/e3', 'xy/cxy.py'):\n"
              "    (root / rel).parent.mkdir(parents=True, exist_ok=True); (root / rel).write_text(rel)\n")
    monkeypatch.setattr(gc, "PLAN", [gc.Phase("compiles", _py(writes), 30)])
    assert gc.main(["--out", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert report["inductor_cache"] == {"installed": 1, "dir": str(gc.DEVICE_INDUCTOR_CACHE), "compiled_on_device": 2}
    assert report["triton_cache"]["returned"]["inductor_saved"] == 2
    packed = tmp_path / "out" / "triton-cache.tar.gz"
    with tarfile.open(packed) as tar:
        assert sorted(tar.getnames()) == ["inductor/aotautograd/cc/k3/e3", "inductor/fxgraph/bb/k2/e2"]
    nxt = tmp_path / "next"
    assert gc.add_device_inductor_cache(packed, nxt) == 2
    assert _files(nxt) == ["aotautograd/cc/k3/e3", "fxgraph/bb/k2/e2"]
    assert (nxt / "fxgraph/bb/k2/e2").read_text() == "fxgraph/bb/k2/e2"
    assert gc.add_device_inductor_cache(tmp_path / "out", tmp_path / "none") == 0  # a folder without inductor/


def test_inductor_graph_caches_moved_to_another_folder_are_hits(tmp_path):
    """What travels (the fxgraph and aotautograd caches, through the tar and --device-cache) is enough for a process
    compiling the same function elsewhere to find its graph there: Inductor's and AOTAutograd's cache hits (CPU
    Inductor here; on a GPU the same caches hold flex attention's kernels)."""
    code = ("import json, torch\n"
            "from torch._dynamo.utils import counters\n"
            "f = torch.compile(lambda x, w: torch.nn.functional.silu(x @ w).sum(-1))\n"
            "x, w = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)\n"
            "f(x, w).sum().backward()\n"
            "print(json.dumps({**counters['inductor'], **counters['aot_autograd']}))\n")

    def run(cache: Path) -> dict:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.splitlines()[-1])

    first = run(tmp_path / "device")
    assert first.get("fxgraph_cache_miss", 0) > 0 and not first.get("fxgraph_cache_hit")
    packed = tmp_path / "triton-cache.tar.gz"
    back = gc.save_compiled({"entries": []}, packed, src=tmp_path / "no-triton", inductor_src=tmp_path / "device")
    assert back["inductor_saved"] == back["inductor_of"] > 0
    assert gc.add_device_inductor_cache(packed, tmp_path / "carried") == back["inductor_saved"]
    env = {}
    gc.install_inductor_cache(env, tmp_path / "carried", tmp_path / "next-device")
    second = run(Path(env["TORCHINDUCTOR_CACHE_DIR"]))
    assert second.get("fxgraph_cache_hit", 0) == first["fxgraph_cache_miss"] and not second.get("fxgraph_cache_miss")
    assert second.get("autograd_cache_hit", 0) > 0


def test_the_precompiled_cache_is_installed_where_triton_finds_its_files(tmp_path):
    """Triton reaches an entry's files through the absolute paths its group file records: installed elsewhere, they
    are rewritten to the new place. A folder that is no entry, or an entry whose group file is damaged, is left
    behind (the run goes on; that kernel compiles there); no carried cache, nothing set."""
    src, dest = tmp_path / "carried", tmp_path / "device"
    _entry(src, "AAA", "_fwd_kernel")
    _entry(src, "BBB", "_bwd_kernel")
    _entry(src, "CCC", "_coef_fwd_kernel")
    (src / "CCC" / "__grp___coef_fwd_kernel.json").write_text("{not json")  # damaged: left out, not fatal
    (src / "stray").mkdir()
    (src / "precompiled.json").write_text("{")
    env = {}
    cache = gc.install_triton_cache(env, src, dest)
    assert env["TRITON_CACHE_DIR"] == str(dest.resolve()) and cache["made_with"] is None
    assert cache["installed"] == 2 and cache["entries"] == ["AAA", "BBB"] and not (dest / "stray").exists()
    assert cache["unreadable"] == ["CCC"] and not (dest / "CCC").exists()
    grp = json.loads((dest / "AAA" / "__grp___fwd_kernel.json").read_text())
    assert grp["child_paths"] == {"_fwd_kernel.json": str(dest.resolve() / "AAA" / "_fwd_kernel.json"),
                                  "_fwd_kernel.cubin": str(dest.resolve() / "AAA" / "_fwd_kernel.cubin")}
    assert gc.compiled_on_device(cache, dest) == []
    env = {}
    empty = gc.install_triton_cache(env, tmp_path / "none", dest)
    assert empty["installed"] == 0 and "run --prepare" in empty["why"] and "TRITON_CACHE_DIR" not in env


def test_layer_benchmark_times_each_backward_form_and_profiles_the_kernels(monkeypatch):
    """benchmarks/titans.py's kernel columns (on a GPU; here the kernels under the interpreter, at a tiny odd
    shape): ``kernel_backward`` names the form the ``kernel_*`` columns ran, each other form asked for gets its own
    columns through ``MEMTRAIN_TITANS_BACKWARD`` (set only while they run), computing what the default does, and
    ``--profile K`` adds one profiled forward+backward (its wall time, busy fraction, top K ops). The split form
    splits the forward too."""
    import warnings

    from memtrain.kernels.titans import BACKWARD_ENV, FORWARD_ENV

    bench = _load("titans_bench", ROOT / "benchmarks" / "titans.py")
    monkeypatch.delenv(BACKWARD_ENV, raising=False)
    monkeypatch.delenv(FORWARD_ENV, raising=False)
    launched = []
    real = bench.profile_call

    def spy(fn, device, top):
        launched.append(os.environ.get(BACKWARD_ENV))
        return real(fn, device, top)

    monkeypatch.setattr(bench, "profile_call", spy)
    from memtrain.kernels.titans import triton_kernels as tk

    ran, form, ran_fwd, form_fwd = [], tk.backward_form, [], tk.forward_form

    def seen():  # the form each scan backward runs
        ran.append(form())
        return ran[-1]

    def seen_fwd(chunk):  # and each scan forward
        ran_fwd.append(form_fwd(chunk))
        return ran_fwd[-1]

    monkeypatch.setattr(tk, "backward_form", seen)
    monkeypatch.setattr(tk, "forward_form", seen_fwd)
    from memtrain.kernels.titans import output

    gated = []  # the fused output stage's calls: in half precision only (here autocast("cuda") is off, all float32)
    monkeypatch.setattr(output, "gated_norm", lambda y, *a, _f=output.gated_norm: gated.append(y.dtype) or _f(y, *a))
    torch.manual_seed(0)
    mem = bench.make_memory(24, 2, 2, 4)  # head size 12, chunks of 4
    x = torch.randn(1, 19, 24)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # autocast("cuda") on a machine without CUDA
        out = bench.kernel_columns(mem, x, x[:, :11], 1, {"chunked": 1.0}, any_depth=False,
                                   forms=("shipped", "lean", "split"), profile=2, weights_dtype=torch.float16)
    # the defaults: the shipped forward, the split backward -- no form of FORMS, so each gets its columns
    assert (out["kernel_forward"], out["kernel_backward"]) == ("shipped", "split") and launched == [None]
    assert [f for i, f in enumerate(ran) if i == 0 or ran[i - 1] != f] == ["split", "shipped", "lean", "split"], ran
    assert [f for i, f in enumerate(ran_fwd) if i == 0 or ran_fwd[i - 1] != f] == ["shipped", "split"], ran_fwd
    assert BACKWARD_ENV not in os.environ and FORWARD_ENV not in os.environ and mem.kernel == "torch"
    for prefix in ("kernel", "kernel_shipped", "kernel_lean", "kernel_split"):
        assert out[f"{prefix}_bf16_tokens_per_s"] > 0 and out[f"{prefix}_nonfinite"] == 0, out
        assert out[f"{prefix}_max_rel_err_vs_torch"] < 1e-4, (prefix, out)  # float32 here: the scan's own error
    monkeypatch.setattr(tk, "SPLIT_FORWARD", True)  # a form equal to the defaults gets no columns of its own
    again = bench.kernel_columns(mem, x, x[:, :11], 1, {"chunked": 1.0}, any_depth=False, forms=("split",))
    assert again["kernel_forward"] == again["kernel_backward"] == "split" and "kernel_split_first_call_s" not in again
    # the layer as memtrain's bf16 training runs it (float16 here: the interpreter's bfloat16 products are wrong),
    # weights and input in that dtype: within its rounding of the float32 layer
    assert out["kernel_fp16_weights_tokens_per_s"] > 0 and out["kernel_fp16_weights_nonfinite"] == 0, out
    assert out["kernel_fp16_weights_max_rel_err_vs_torch"] < 2e-2, out
    assert gated and set(gated) == {torch.float32}  # the retrievals reach the fused output stage in float32
    assert out["kernel_profile_step_s"] > 0 and 0 < out["kernel_profile_busy_fraction"] <= 1.5
    assert len(out["kernel_profile_top"]) == 2 and all(t["count"] >= 1 for t in out["kernel_profile_top"])
