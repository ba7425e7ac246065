"""memtrain.kernels.precompile: Triton kernels compiled for a GPU on this CPU, by the code that launches them, into
a Triton cache that a GPU machine's first launch finds (``benchmarks/titans_kernels.py --precompile``,
``tools/gpu_check.py --prepare``)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from memtrain.kernels import precompile

ROOT = Path(__file__).resolve().parents[1]


def _no_interpreter() -> dict:
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def _precompile(cache: Path, *extra: str) -> list[dict]:
    """``titans_kernels.py --precompile`` at the tiny depth-2 shape (chunk 4, head size 8, hidden 16): its JSON
    lines."""
    run = subprocess.run([sys.executable, "benchmarks/titans_kernels.py", "--precompile", str(cache), "--tiny",
                          "--shapes", "layer", "--warps", "8", *extra], cwd=ROOT, env=_no_interpreter(),
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


_AOT_TINY = r"""
import json
from memtrain.kernels.titans.aot import compile_kernel

# the sweep's launches at the tiny layer shape (depth 2, head size 8, hidden 16, chunk 4), as _precompile makes them
specs = [("fwd", 4, {}), ("bwd", 4, {}), ("bwd", 4, {"lean": True}), ("fwd", 8, {}), ("bwd", 8, {}),
         ("coef_fwd", 4, {}), ("coef_bwd", 4, {}), ("fwd_advance", 4, {}), ("fwd_read", 4, {}),
         ("bwd_recompute", 4, {}), ("bwd_local", 4, {}), ("bwd_carry", 4, {}), ("fwd_advance", 4, {"stages": 2}),
         ("bwd_recompute", 4, {"stages": 2}), ("bwd_carry", 4, {"stages": 2}), ("fwd", 4, {"any_depth": True}),
         ("bwd", 4, {"any_depth": True})]
out = [compile_kernel(k, 2, head_dim=8, hidden=16, chunk=4, num_warps=w, **{"stages": 1, **kw}) for k, w, kw in specs]
print(json.dumps([[r["cubin_sha256"], r["kernel"], r["any_depth"], r["num_warps"],
                   {k: r[k] for k in ("registers", "shared", "stack_frame", "loops", "program")}] for r in out]))
"""


def _aot_cubins() -> tuple[dict, dict]:
    """``{sha256 of the cubin: (kernel function, num_warps)}`` of :func:`memtrain.kernels.titans.aot.compile_kernel`'s
    17 binaries at the tiny layer shape, compiled in a fresh process without the interpreter, and ``{sha256: its
    registers, shared memory, stack frame, loops and program}``."""
    run = subprocess.run([sys.executable, "-c", _AOT_TINY], cwd=ROOT, env=_no_interpreter(), capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(rows) == 17
    return ({digest: (f"_{kernel}{'_deep' if deep else ''}_kernel", warps) for digest, kernel, deep, warps, _ in rows},
            {digest: figures for digest, *_, figures in rows})


def test_kernel_precompile_fills_a_triton_cache_that_a_second_machine_finds(tmp_path):
    """Every launch of the sweep's variants (shipped with 4 warps, the lean backward, the split forward and backward,
    the same pipelined, 8 warps, any-depth; forward and backward, the gates' backward too) compiles once for sm_90
    without a GPU; a second process, and a copy installed elsewhere (the original deleted: Triton finds entries
    through the paths their group files record), find them all. :func:`memtrain.kernels.titans.aot.compile_kernel`
    compiles the same 17 binaries (the pipelined loops' three with ``stages=2``, as the launches' environment gave), and
    ``--cache-figures`` reads the cache's binaries to the figures compile_kernel gives them."""
    first = _precompile(tmp_path / "a")
    rows, summary = first[:-1], first[-1]
    assert [(r["num_warps"], r["backward"], r["any_depth"]) for r in rows] == [
        (4, "shipped", False), (4, "lean", False), (4, "split", False), (4, "pipelined", False), (8, "shipped", False),
        (4, "shipped", True)]
    split = ["_fwd_advance_kernel", "_fwd_read_kernel", "_bwd_recompute_kernel", "_bwd_local_kernel",
             "_bwd_carry_kernel"]
    assert rows[0]["compiled"] == ["_coef_fwd_kernel", "_fwd_kernel", "_bwd_kernel", "_coef_bwd_kernel"]
    assert rows[1]["compiled"] == ["_bwd_kernel"] and rows[1]["cached"] == []  # the rest reused in memory
    assert rows[2]["compiled"] == split and rows[2]["cached"] == []
    pipelined = ["_fwd_advance_kernel", "_bwd_recompute_kernel", "_bwd_carry_kernel"]  # the loops; the rest reused
    assert rows[3]["compiled"] == pipelined and rows[3]["cached"] == []
    assert rows[4]["compiled"] == ["_fwd_kernel", "_bwd_kernel"]
    assert rows[5]["compiled"] == ["_fwd_deep_kernel", "_bwd_deep_kernel"]
    assert summary["compiled"] == 17 and summary["kernels_in_cache"] == 17 and summary["target"] == "cuda:90"
    kernels = precompile.cache_kernels(tmp_path / "a")
    assert sorted(kernels.values()) == sorted(["_coef_fwd_kernel", "_fwd_kernel", "_bwd_kernel", "_coef_bwd_kernel",
                                               "_bwd_kernel", *split, *pipelined, "_fwd_kernel", "_bwd_kernel",
                                               "_fwd_deep_kernel", "_bwd_deep_kernel"])
    for entry, name in kernels.items():  # binaries for sm_90; the PTX and the compiler's IRs are not kept
        meta = json.loads((tmp_path / "a" / entry / f"{name}.json").read_text())
        assert meta["target"]["arch"] == 90 and meta["name"] == name
        assert sorted(p.suffix for p in (tmp_path / "a" / entry).iterdir()) == [".cubin", ".json", ".json", ".source"]
    assert json.loads((tmp_path / "a" / "precompiled.json").read_text()) == summary
    # aot.compile_kernel (benchmarks/titans_kernels.py --static, the figures in docs/titans-kernels.md) compiles the
    # very binaries these launches compiled, byte for byte: pointers 16-byte aligned and the widths specialised as
    # Triton's JIT does (unspecialised, 10 of the then 14 came out different binaries: all but the shipped pair under
    # 8 warps and the coefficients'), and the split loops pipelined as the launches' MEMTRAIN_TITANS_STAGES=2 gave
    cubins = {hashlib.sha256(c.read_bytes()).hexdigest(): (c.stem, json.loads(c.with_suffix(".json").read_text())[
        "num_warps"]) for c in (tmp_path / "a").glob("*/*.cubin")}
    kernels_of, figures_of = _aot_cubins()
    assert kernels_of == cubins
    # --cache-figures reads every binary in the cache: the same figures compile_kernel gave for the same binary
    run = subprocess.run([sys.executable, "benchmarks/titans_kernels.py", "--cache-figures", str(tmp_path / "a")],
                         cwd=ROOT, env=_no_interpreter(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    read = [json.loads(line) for line in run.stdout.splitlines()]
    assert sorted((r["kernel"], r["num_warps"]) for r in read) == sorted(cubins.values())
    for r in read:
        digest = hashlib.sha256(next((tmp_path / "a" / r["entry"]).glob("*.cubin")).read_bytes()).hexdigest()
        assert {k: r[k] for k in figures_of[digest]} == figures_of[digest], r
    # a corrupted entry (its metadata cut short): one line naming it, exit 2
    shutil.copytree(tmp_path / "a", tmp_path / "bad")
    entry = read[0]["entry"]
    (tmp_path / "bad" / entry / f"{read[0]['kernel']}.json").write_text('{"num_w')
    run = subprocess.run([sys.executable, "benchmarks/titans_kernels.py", "--cache-figures", str(tmp_path / "bad")],
                         cwd=ROOT, env=_no_interpreter(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and run.stdout == "", run.stdout[-2000:]
    assert f"{entry}: not a readable Triton cache entry" in run.stderr.splitlines()[-1], run.stderr[-2000:]
    shutil.rmtree(tmp_path / "bad")

    again = _precompile(tmp_path / "a")
    assert all(r["compiled"] == [] for r in again[:-1]) and again[-1]["compiled"] == 0 and again[-1]["cached"] == 17

    installed = precompile.install_cache(tmp_path / "a", tmp_path / "b")
    assert installed == kernels
    shutil.rmtree(tmp_path / "a")
    moved = _precompile(tmp_path / "b")
    assert moved[-1]["compiled"] == 0 and moved[-1]["cached"] == 17


def test_kernel_precompile_compiles_a_recipes_kernels_around_the_scan_as_its_training_launches_them(tmp_path):
    """``--recipes``: one block of a Titans recipe, forward and backward in bf16 as a GPU trains it, compiles the
    kernels its first step launches besides the sweep's: the chunk coefficients, the fused prologue (the convolution
    and q/k/v, its weight gradients' sum, the gates), output stage, MAC's retrieval and RoPE (queries and keys), each
    way; a second run finds them all. A recipe that is not a Titans one, or no recipe, is one argparse line before
    any compiling."""
    rows = _precompile(tmp_path / "c", "--recipes", "recipes/titans-cpu-mac.yaml")
    recipe, summary = rows[-2], rows[-1]
    assert recipe["recipe"] == "recipes/titans-cpu-mac.yaml" and summary["recipes"] == [recipe["recipe"]]
    around = {"_coef_fwd_kernel", "_coef_bwd_kernel", "_qkv_fwd_kernel", "_qkv_bwd_kernel", "_conv_grad_kernel",
              "_gates_fwd_kernel", "_gates_bwd_kernel", "_out_fwd_kernel", "_out_bwd_kernel", "_read_fwd_kernel",
              "_read_bwd_kernel", "_rope_kernel"}
    assert around <= set(recipe["compiled"])
    again = _precompile(tmp_path / "c", "--recipes", "recipes/titans-cpu-mac.yaml")
    assert again[-2]["compiled"] == [] and set(again[-2]["cached"]) == set(recipe["compiled"])
    for bad, why in (("recipes/quickstart.yaml", "only used with model.type 'titans'"),
                     ("recipes/nope.yaml", "does not exist")):
        run = subprocess.run([sys.executable, "benchmarks/titans_kernels.py", "--precompile", str(tmp_path / "d"),
                              "--tiny", "--shapes", "layer", "--recipes", bad], cwd=ROOT, env=_no_interpreter(),
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 2 and why in run.stderr.splitlines()[-1] and not (tmp_path / "d").exists()


def test_kernel_precompile_restores_triton_and_keys_another_build(tmp_path):
    """Inside compile_only a launch compiles and returns (no GPU here to launch on), the CPU tensors are allowed;
    after it Triton's driver, cache settings, key function and launch path are as before and the kernels' in-memory
    binaries are dropped. A foreign libtriton digest changes the key exactly where this build's digest was."""
    code = f"""
import hashlib, json, torch, triton
from triton import knobs
from triton.runtime import cache, driver
from triton.runtime.jit import JITFunction
from memtrain.kernels import precompile
from memtrain.kernels.titans import scan, triton_kernels
before = (driver._active, knobs.cache.dir, knobs.compilation.store_binary_only, knobs.compilation.listener,
          cache.triton_key, JITFunction.run)
q = torch.randn(1, 8, 8).bfloat16()
w = [torch.randn(1, 16, 8), torch.randn(1, 8, 16)]
s = [torch.zeros_like(x) for x in w]
gates = [torch.rand(1, 8) * 0.01, -torch.rand(1, 8), -torch.rand(1, 8)]
try:
    scan(q, q, q, *gates, w, s, w, 0, 4, kernel="triton")
    raise SystemExit("a CPU launch outside compile_only should fail")
except RuntimeError as e:
    assert "TRITON_INTERPRET" in str(e), e
with precompile.compile_only("cuda:90", {str(tmp_path)!r}) as report:
    assert precompile.ACTIVE
    y = scan(q, q, q, *gates, w, s, w, 0, 4, kernel="triton")[0]
after = (driver._active, knobs.cache.dir, knobs.compilation.store_binary_only, knobs.compilation.listener,
         cache.triton_key, JITFunction.run)
assert after == before and not precompile.ACTIVE
assert report.compiled == ["_coef_fwd_kernel", "_fwd_kernel"], report.compiled
assert all(not c for c in triton_kernels._fwd_kernel.device_caches.values())
own = precompile.triton_key_digest()
other = precompile.triton_key_digest("0" * 64)
lib = precompile._sha256_file(precompile._own_libtriton())
assert own == report.triton_key and other != own
assert other == hashlib.sha256(cache.triton_key().replace(lib, "0" * 64).encode()).hexdigest()
print("ok")
"""
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_no_interpreter(), capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-2000:] + run.stderr[-3000:]


def _wheel(path: Path, version: str, files: dict) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"triton-{version}.dist-info/METADATA", f"Name: triton\nVersion: {version}\n")
        for name, data in files.items():
            zf.writestr(name, data)
    return path


def test_libtriton_digest_reads_the_native_library_of_the_same_triton_only(tmp_path):
    import triton

    cache_py = (Path(triton.__file__).parent / "runtime" / "cache.py").read_bytes()
    lib = b"\x7fELF another python's build" * 1000
    good = _wheel(tmp_path / "good.whl", triton.__version__,
                  {"triton/runtime/cache.py": cache_py, "triton/_C/libtriton.so": lib})
    assert precompile.libtriton_digest(good) == hashlib.sha256(lib).hexdigest()
    other = _wheel(tmp_path / "other.whl", "0.0.1", {"triton/_C/libtriton.so": lib})
    with pytest.raises(ValueError, match="is Triton 0.0.1"):
        precompile.libtriton_digest(other)
    changed = _wheel(tmp_path / "changed.whl", triton.__version__,
                     {"triton/runtime/cache.py": cache_py + b"\n# patched\n", "triton/_C/libtriton.so": lib})
    with pytest.raises(ValueError, match="differ in 1 Python file"):
        precompile.libtriton_digest(changed)
    with pytest.raises(ValueError, match="no triton/_C/libtriton.so"):
        precompile.libtriton_digest(_wheel(tmp_path / "nolib.whl", triton.__version__, {}))
    with pytest.raises(ValueError, match="no Triton wheel at"):
        precompile.libtriton_digest(tmp_path / "missing.whl")
    (tmp_path / "broken.whl").write_bytes(b"\x00" * 200)
    with pytest.raises(ValueError, match="is not a wheel"):
        precompile.libtriton_digest(tmp_path / "broken.whl")
    with pytest.raises(ValueError, match="'cuda:<compute capability>'"):
        precompile.parse_target("sm_90")
