"""Titans inner-loop kernels alone, at the shapes the layer benchmark and the recipes give them, under several
launch configurations: which number of warps to ship.

What. For each shape (``N`` = batch x heads programs, ``T`` tokens per call, head size, hidden width, depth,
chunk) and each variant of the kernels' launch options (``num_warps`` 4, 8, 16; the default is what
``_launch_shape`` picks), times the scan forward and forward+backward (``memtrain.kernels.titans.scan`` with
``kernel="triton"``: bf16 q / k / v, fp32 gates and state, as bf16 training calls it) with
``triton.testing.do_bench`` (median of the repeats, milliseconds), and reports tokens/s, the compiled
kernels' registers, spills and shared memory where Triton exposes them, and the largest relative error of
the output and of the q / k / v gradients against the default variant (a launch option must not change the
result beyond rounding). One JSON line per shape and variant; ``default: true`` marks the shipped choice.

At depth 1-2 the any-depth kernels (``kernels: triton_deep``: the state in memory, not in registers; what
depth 3+ runs) are timed beside the shipped pair at their default launch: at the recipes' shapes the pair's
state spills from registers (``--static``), so which is faster is measured, not assumed. So is the pair's
lean backward (``lean_backward: true``, :data:`memtrain.kernels.titans.triton_kernels.LEAN_BACKWARD`: the same
computation ordered so that fewer state tiles ride through its loops, whose spills move less memory under one
Triton's compiler and more under another).

Shapes. ``layer``: the layer benchmark's target (B4 x 8 heads, T 2048, head 64, hidden 128, depth 2, chunk
64); ``mac``: titans-170m/340m-mac's memory writes (B4 x 12 heads, one 512-token segment per call, chunk 16);
``mag``: titans-400m-mag's (B4 x 16 heads, T 4096, chunk 16); ``deep``: depth 3 at the layer target (the
any-depth kernels).

    python benchmarks/titans_kernels.py                   # GPU: every shape, num_warps 4 / 8 / 16
    python benchmarks/titans_kernels.py --shapes layer --warps 8,16
    TRITON_INTERPRET=1 python benchmarks/titans_kernels.py --interpret   # CPU smoke run at tiny shapes
    python benchmarks/titans_kernels.py --static          # any machine: compiled for sm_90, nothing timed

``--static`` needs no GPU: it compiles each shape's forward and backward kernels for an H100 / H200 (sm_90,
Triton's own ptxas; :mod:`memtrain.kernels.titans.aot`) under each launch and prints their registers per
thread, bytes of spill stores and loads per thread, shared memory and each innermost loop's instructions and
local-memory loads, stores and bytes per iteration (``fwd_loops``, ``bwd_loops``: read from the compiled code), one JSON
line per shape, kernels and launch; at depth 1-2 also the any-depth kernels (``kernels: triton_deep``), which keep
the state in memory rather than in registers. Spills are the first thing to read about a launch: they put the
state's registers in local memory inside the loop over chunks, and the loops' figures say how many run per chunk
(``local_kib_per_program``: what they move per chunk for the whole program, mostly to and from L2). On a GPU the
timed records carry the same ``fwd_loops`` / ``bwd_loops`` of the kernels the device's own Triton compiled, so the
timings sit beside the traffic (the static figures come from this machine's Triton, which may compile differently).

Not part of the test suite; the timings mean something on a GPU only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memtrain.kernels import titans as titans_kernels  # noqa: E402
from memtrain.kernels.titans import triton_deep, triton_kernels  # noqa: E402

SHAPES = {  # name: (N, T, head_dim, hidden, depth, chunk)
    "layer": (32, 2048, 64, 128, 2, 64),
    "mac": (48, 512, 64, 128, 2, 16),
    "mag": (64, 4096, 64, 128, 2, 16),
    "deep": (32, 2048, 64, 128, 3, 64),
}
TINY = {"layer": (3, 19, 8, 16, 2, 4), "deep": (2, 11, 8, 8, 3, 4)}


def inputs(N, T, D, hidden, depth, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device)

    half = torch.bfloat16 if device.type == "cuda" else torch.float16  # the interpreter's bf16 dot is wrong
    q = F.normalize(randn(N, T, D), dim=-1).to(half)
    k = F.normalize(randn(N, T, D), dim=-1).to(half)
    v = randn(N, T, D).to(half)
    lr = 0.005 * torch.rand(N, T, generator=g).to(device)  # theta as the recipes' initialisation
    log_eta = F.logsigmoid(randn(N, T))
    log_keep = F.logsigmoid(randn(N, T) + 3.0)
    sizes = [D] + [hidden] * (depth - 1) + [D]
    w = [randn(N, o, i) / i ** 0.5 for i, o in zip(sizes[:-1], sizes[1:])]
    s = [torch.zeros_like(x) for x in w]
    return q, k, v, lr, log_eta, log_keep, w, s


def _compiled_info(fn) -> dict:
    """Registers, spills and shared memory of the kernel ``fn`` compiled last (None where Triton hides them), and
    its innermost loops as the device's own Triton compiled them (``loops``: instructions, local-memory bytes per
    iteration, :func:`memtrain.kernels.titans.aot.sass_loops`; absent without ``nvdisasm``)."""
    try:
        for cache in getattr(fn, "device_caches", {}).values():
            kernels = list(cache[0].values())
            if kernels:
                k = kernels[-1]
                info = {"n_regs": getattr(k, "n_regs", None), "n_spills": getattr(k, "n_spills", None),
                        "shared": getattr(k.metadata, "shared", None)}
                info.update(_loop_info(k))
                return info
    except Exception:  # a Triton version without these attributes
        pass
    return {}


def _loop_info(kernel) -> dict:
    """``loops`` of a launched kernel's cubin as :func:`memtrain.kernels.titans.aot.compile_kernel` reports them
    ahead of time (with ``local_kib_per_program``): the timings set beside the traffic the static figures predict."""
    from memtrain.kernels.titans.aot import cubin_loops

    try:
        loops = cubin_loops(kernel.asm["cubin"], kernel.metadata.num_warps)
    except Exception:  # no cubin (the interpreter) or no nvdisasm run
        return {}
    return {} if loops is None else {"loops": loops}


def _module(depth: int):
    return triton_deep if depth >= titans_kernels.DEEP_KERNEL_MIN_DEPTH else triton_kernels


def default_warps(shape) -> int:
    N, T, D, hidden, depth, C = shape
    return _module(depth)._launch_shape(D, hidden, C)["num_warps"]


def measure(shape, warps, device, repeats_ms: int, any_depth: bool = False, lean: bool = False) -> tuple[
        dict, tuple]:
    """Time the kernels at ``shape`` with ``num_warps=warps`` (None: the default); the record and the outputs.
    ``any_depth``: the any-depth kernels (:mod:`.triton_deep`, the state in memory) at depth 1-2 too. ``lean``:
    the depth-1/2 backward's lean form (:data:`.triton_kernels.LEAN_BACKWARD`)."""
    N, T, D, hidden, depth, C = shape
    deep_from = titans_kernels.DEEP_KERNEL_MIN_DEPTH
    mod = triton_deep if any_depth else _module(depth)
    base = mod._launch_shape
    default = mod._launch_shape(D, hidden, C)["num_warps"]

    def launch(*a):
        opts = base(*a)
        if warps is not None:
            opts["num_warps"] = warps
        return opts

    q, k, v, lr, log_eta, log_keep, w, s = inputs(N, T, D, hidden, depth, device)
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
    mod._launch_shape = launch
    lean_from, triton_kernels.LEAN_BACKWARD = triton_kernels.LEAN_BACKWARD, lean
    if any_depth:
        titans_kernels.DEEP_KERNEL_MIN_DEPTH = 1  # scan() picks the any-depth kernels at every depth
    try:
        def fwd():
            return titans_kernels.scan(*leaves, lr, log_eta, log_keep, w, s, w, 0, C, kernel="triton")[0]

        def fwd_bwd():
            y = fwd()
            return torch.autograd.grad(y.float().square().sum(), leaves)

        t0 = time.perf_counter()
        y = fwd()
        grads = torch.autograd.grad(y.float().square().sum(), leaves)
        if device.type == "cuda":
            torch.cuda.synchronize()
        first_s = time.perf_counter() - t0
        if device.type == "cuda":
            from triton.testing import do_bench

            fwd_ms = do_bench(fwd, warmup=25, rep=repeats_ms, return_mode="median")
            fwd_bwd_ms = do_bench(fwd_bwd, warmup=25, rep=repeats_ms, return_mode="median")
        else:  # the interpreter: one call each, the columns filled, the numbers meaningless
            t0 = time.perf_counter()
            fwd()
            fwd_ms = (time.perf_counter() - t0) * 1e3
            t0 = time.perf_counter()
            fwd_bwd()
            fwd_bwd_ms = (time.perf_counter() - t0) * 1e3
        info = {f"fwd_{k}": x for k, x in _compiled_info(getattr(mod, "_fwd_kernel", None)
                                                      or getattr(mod, "_fwd_deep_kernel", None)).items()}
        info.update({f"bwd_{k}": x for k, x in _compiled_info(getattr(mod, "_bwd_kernel", None)
                                                           or getattr(mod, "_bwd_deep_kernel", None)).items()})
    finally:
        mod._launch_shape = base
        triton_kernels.LEAN_BACKWARD = lean_from
        titans_kernels.DEEP_KERNEL_MIN_DEPTH = deep_from
    shipped = mod is _module(depth)
    rec = {"N": N, "T": T, "head_dim": D, "hidden": hidden, "depth": depth, "chunk": C,
           "kernels": mod.__name__.rsplit(".", 1)[-1], "num_warps": warps or default, "lean_backward": lean,
           "default": shipped and (warps is None or warps == default) and not lean,
           "first_call_s": round(first_s, 2),
           "fwd_ms": round(fwd_ms, 4), "fwd_bwd_ms": round(fwd_bwd_ms, 4),
           "fwd_tokens_per_s": round(N * T / fwd_ms * 1e3, 1), "fwd_bwd_tokens_per_s": round(N * T / fwd_bwd_ms * 1e3, 1),
           **info}
    return rec, (y.detach().float(), *(g.float() for g in grads))


def _compile(spec: tuple) -> dict:
    from memtrain.kernels.titans.aot import compile_kernel

    kernel, shape, warps, any_depth, lean = spec
    N, T, D, hidden, depth, C = shape
    try:
        return compile_kernel(kernel, depth, D, hidden, C, num_warps=warps, any_depth=any_depth, lean=lean)
    except Exception as e:  # one launch that fails to compile must not end the table
        return {"kernel": kernel, "error": f"{type(e).__name__}: {e}"[:500]}


def static(warps: list[int], names: list[str], table: dict = SHAPES) -> int:
    """``--static``: each shape's kernels compiled for sm_90 under each launch, one JSON line per shape, kernels
    (register-resident or any-depth), ``num_warps`` and backward form (``lean_backward``), with the forward's and
    backward's registers, spills, shared memory and innermost loops (instructions and local-memory loads, stores
    and bytes per iteration and thread: the spills that run per chunk; :func:`memtrain.kernels.titans.aot.
    sass_loops`). The compiles run in parallel (one process per core)."""
    import multiprocessing

    rows = []
    for name in names:
        shape = table[name]
        depth = shape[4]
        variants = [(depth >= titans_kernels.DEEP_KERNEL_MIN_DEPTH, w, False)
                    for w in dict.fromkeys([default_warps(shape), *warps])]
        if depth < titans_kernels.DEEP_KERNEL_MIN_DEPTH:  # the lean backward and the any-depth kernels, default launch
            variants += [(False, None, True), (True, None, False)]
        rows += [(name, shape, any_depth, w, lean) for any_depth, w, lean in variants]
    # a compiled kernel depends on the widths, depth and chunk, not on N or T (mac and mag share theirs); the
    # forward has one form
    def key(kernel, shape, any_depth, w, lean):
        return kernel, shape[2:], w, any_depth, lean and kernel == "bwd"

    specs = {key(kernel, shape, any_depth, w, lean): (kernel, shape, w, any_depth, lean and kernel == "bwd")
             for _, shape, any_depth, w, lean in rows for kernel in ("fwd", "bwd")}
    todo = sorted(specs, key=lambda k: k[0] == "fwd")  # the slow backwards first
    with multiprocessing.get_context("fork").Pool(os.cpu_count() or 1) as pool:
        compiled = dict(zip(todo, pool.map(_compile, [specs[k] for k in todo], chunksize=1)))
    failed = 0
    for name, shape, any_depth, w, lean in rows:
        rec = {"shape": name, "device": "sm_90 (compiled ahead of time, not run)", "N": shape[0], "T": shape[1],
               "head_dim": shape[2], "hidden": shape[3], "depth": shape[4], "chunk": shape[5],
               "kernels": "triton_deep" if any_depth else "triton_kernels", "lean_backward": lean}
        for r in (compiled[key(kernel, shape, any_depth, w, lean)] for kernel in ("fwd", "bwd")):
            if "error" in r:
                rec[f"{r['kernel']}_error"] = r["error"]
                failed += 1
                continue
            rec["num_warps"] = r["num_warps"]
            rec.update({f"{r['kernel']}_{k}": r[k] for k in ("registers", "spill_stores", "spill_loads", "shared",
                                                             "loops")})
        mod = triton_deep if any_depth else triton_kernels
        shipped = any_depth == (shape[4] >= titans_kernels.DEEP_KERNEL_MIN_DEPTH) and not lean
        rec["default"] = shipped and (w is None or w == mod._launch_shape(shape[2], shape[3], shape[5])["num_warps"])
        print(json.dumps(rec), flush=True)
    return 1 if failed else 0


def _rel(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=None, help=f"comma-separated, of {', '.join(SHAPES)} (default: all)")
    ap.add_argument("--warps", default="4,8,16", help="num_warps variants besides the default (comma-separated)")
    ap.add_argument("--rep-ms", type=int, default=200, help="do_bench's repetition time per measurement")
    ap.add_argument("--interpret", action="store_true", help="CPU smoke run at tiny shapes (TRITON_INTERPRET=1)")
    ap.add_argument("--static", action="store_true",
                    help="no GPU needed: compile for sm_90 and report registers, spills and shared memory, untimed")
    ap.add_argument("--tiny", action="store_true", help="with --static: the tiny shapes of --interpret (a quick check)")
    args = ap.parse_args()
    table = TINY if args.interpret or args.tiny else SHAPES
    if args.static:
        if os.environ.get("TRITON_INTERPRET") == "1":
            ap.error("--static compiles for a GPU: unset TRITON_INTERPRET")
        names = args.shapes.split(",") if args.shapes else list(table)
        unknown = [n for n in names if n not in table]
        if unknown:
            ap.error(f"unknown shape(s) {', '.join(unknown)}; choose from {', '.join(table)}")
        return static([int(x) for x in args.warps.split(",") if x.strip()], names, table)
    names = args.shapes.split(",") if args.shapes else list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        ap.error(f"unknown shape(s) {', '.join(unknown)}; choose from {', '.join(table)}")
    if args.interpret:
        if os.environ.get("TRITON_INTERPRET") != "1":
            ap.error("--interpret needs TRITON_INTERPRET=1 in the environment (set before Triton is imported)")
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        ap.error("no CUDA device: the kernels are timed on a GPU (or pass --interpret for a CPU smoke run)")
    else:
        device = torch.device("cuda")
    warps = [int(x) for x in args.warps.split(",") if x.strip()]
    for name in names:
        ref = None
        variants = [(None, False, False)]
        if table[name][4] < titans_kernels.DEEP_KERNEL_MIN_DEPTH:  # the backward's lean form (LEAN_BACKWARD) next
            variants.append((None, False, True))
        variants += [(w, False, False) for w in warps if w != default_warps(table[name])]
        if table[name][4] < titans_kernels.DEEP_KERNEL_MIN_DEPTH:  # the any-depth kernels, default launch
            variants.append((None, True, False))
        for variant, any_depth, lean in variants:
            try:
                rec, outs = measure(table[name], variant, device, args.rep_ms, any_depth, lean)
            except Exception as e:  # one variant that fails to compile or launch must not end the sweep
                print(json.dumps({"shape": name, "num_warps": variant, "any_depth": any_depth, "lean_backward": lean,
                                  "error": f"{type(e).__name__}: {e}"[:500]}), flush=True)
                continue
            if ref is None:
                ref = outs
            rec["max_rel_err_vs_default"] = max(_rel(a, b) for a, b in zip(outs, ref))
            print(json.dumps({"shape": name, "device": torch.cuda.get_device_name() if device.type == "cuda"
                              else "cpu (interpreter)", **rec}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
