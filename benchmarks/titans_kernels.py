"""Titans inner-loop kernels alone, at the shapes the layer benchmark and the recipes give them, under several
launch configurations: which number of warps to ship.

What. For each shape (``N`` = batch x heads programs, ``T`` tokens per call, head size, hidden width, depth,
chunk) and each variant of the kernels' launch options (``num_warps`` 4, 8, 16; the default is what
``_launch_shape`` picks), times the scan forward and forward+backward (``memtrain.kernels.titans.scan`` with
``kernel="triton"``: bf16 q / k / v, fp32 gates and state, as bf16 training calls it) with
``triton.testing.do_bench`` (median of the repeats, milliseconds), and reports tokens/s, the compiled
kernels' registers, spills and shared memory where Triton exposes them, and the largest relative error of
the output and of the q / k / v gradients against the default variant (a launch option must not change the
result beyond rounding). One JSON line per shape and variant; ``default: true`` marks the reference: the shipped
forms at the launch ``_launch_shape`` picks (each form is set through its variable, whatever the module's defaults).

At depth 1-2 the any-depth kernels (``kernels: triton_deep``: the state in memory, not in registers; what
depth 3+ runs) are timed beside the shipped pair at their default launch: at the recipes' shapes the pair's
state spills from registers (``--static``), so which is faster is measured, not assumed. So are the pair's
other two forms (``backward``): ``lean`` (:data:`memtrain.kernels.titans.triton_kernels.LEAN_BACKWARD`:
the same computation ordered so that fewer state tiles ride through its loops, whose spills move less memory under
one Triton's compiler and more under another) and ``split`` (:data:`~memtrain.kernels.titans.triton_kernels.
SPLIT_BACKWARD`: the chunks' own part of the backward in parallel, one program per chunk, and only the carried part
in the loop over chunks; with :data:`~memtrain.kernels.titans.triton_kernels.SPLIT_FORWARD`, ``forward: split``:
the forward's reads in parallel and only the recurrence in the loop), and ``pipelined``: the split forward and backward
with their loops over chunks software-pipelined in 2 stages (``MEMTRAIN_TITANS_STAGES=2``, ``stages``: the loads of the
next chunk's tiles issued while the current one computes; :func:`~memtrain.kernels.titans.triton_kernels.loop_stages`).
``--forms split,pipelined`` times only those forms at the default launch (no other warps, waves or any-depth
kernels): the GPU check's quick comparison. ``--waves 16,32`` times the shipped launch
with its one-program-per-sequence kernels in waves of that many programs (``MEMTRAIN_TITANS_WAVE``, ``wave``:
programs per launch, ``launches``): the same binary and result, fewer stack frames live at once. On an H200 every
wave ran about as long as the whole launch, so the time grew with the number of waves (docs/titans-kernels.md,
"Measured: the forms and waves"); none by default. Every
timed record also gives ``fwd_us_per_chunk`` and ``bwd_us_per_chunk``: the call's time over its chunks (all programs
at once), the unit the frames model predicts in.

Shapes. ``layer``: the layer benchmark's target (B4 x 8 heads, T 2048, head 64, hidden 128, depth 2, chunk
64); ``mac``: titans-170m/340m-mac's memory writes (B4 x 12 heads, one 512-token segment per call, chunk 16);
``mag``: titans-400m-mag's (B4 x 16 heads, T 4096, chunk 16); ``deep``: depth 3 at the layer target (the
any-depth kernels).

    python benchmarks/titans_kernels.py                   # GPU: every shape, num_warps 4 / 8 / 16
    python benchmarks/titans_kernels.py --shapes layer --warps 8,16
    TRITON_INTERPRET=1 python benchmarks/titans_kernels.py --interpret   # CPU smoke run at tiny shapes
    python benchmarks/titans_kernels.py --static          # any machine: compiled for sm_90, nothing timed
    python benchmarks/titans_kernels.py --precompile DIR --shapes mac,layer   # any machine: into a Triton cache
    python benchmarks/titans_kernels.py --cache-figures DIR   # any machine: the figures of the binaries in a cache

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
``--static`` specialises the scan's arguments as a launch does (pointers 16-byte aligned, the widths divisible by 16),
so its scan kernels are the launches' own binaries, byte for byte (tests/test_precompile.py).

``--precompile DIR`` needs no GPU either: it runs every launch the sweep would make at ``--shapes`` (forward and
backward, the gates' backward too) through :func:`memtrain.kernels.precompile.compile_only`, which compiles each for
``--target`` (default ``cuda:90``) into the Triton cache ``DIR`` and launches nothing, so a GPU machine whose Triton
cache holds ``DIR``'s entries starts timing at once (``tools/gpu_check.py --prepare`` does this for the GPU check;
``--libtriton-from`` gives the GPU machine's Triton wheel when its Python differs from this one's); ``--recipes
FILES`` adds, for each Titans recipe, one block's forward and backward as its training runs it (the kernels around
the scan: coefficients, fused prologue, output stage, MAC's retrieval, RoPE). One JSON line per shape and variant and
per recipe: the kernels it compiled and those the cache held. The timed records say the same of their first call
(``triton_compiled``, ``triton_cached``).

``--cache-figures DIR`` reads every binary in a Triton cache directory (``--precompile``'s, ``tools/gpu_check.py
--prepare``'s ``.gpu/triton-cache``, or a GPU machine's own) and prints one JSON line per binary: its kernel, warps,
shared memory, registers, stack frame and loops (:func:`memtrain.kernels.titans.aot.cache_figures`). These are exact for
every kernel as its launch compiled it, the kernels around the scan too, whose lengths and strides ``--static`` leaves
unspecialised. Run it with the Triton that compiled the cache first on the path (its ``nvdisasm`` and ``cuobjdump``).
A missing or empty directory, or an entry it cannot read, is one error line naming it (exit 2).

Not part of the test suite; the timings mean something on a GPU only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memtrain.kernels import titans as titans_kernels  # noqa: E402
from memtrain.kernels.precompile import compile_events  # noqa: E402
from memtrain.kernels.titans import triton_deep, triton_kernels  # noqa: E402

SHAPES = {  # name: (N, T, head_dim, hidden, depth, chunk)
    "layer": (32, 2048, 64, 128, 2, 64),
    "mac": (48, 512, 64, 128, 2, 16),
    "mag": (64, 4096, 64, 128, 2, 16),
    "deep": (32, 2048, 64, 128, 3, 64),
}
TINY = {"layer": (9, 7, 8, 16, 2, 4), "deep": (2, 11, 8, 8, 3, 4)}  # layer: above one wave of 8 programs


def inputs(N, T, D, hidden, depth, device, seed=0, half=None):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device)

    if half is None:  # bf16 as training runs the kernels; the interpreter's bf16 dot is wrong
        half = torch.bfloat16 if device.type == "cuda" else torch.float16
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
    """``loops`` and ``program`` (the whole kernel) of a launched kernel's cubin as
    :func:`memtrain.kernels.titans.aot.compile_kernel` reports them ahead of time (with ``local_kib_per_program``),
    and its stack frame (``stack_frame``, ``frame_kib_per_program``): the timings set beside the traffic the static
    figures predict and the local memory the running programs keep live."""
    from memtrain.kernels.titans.aot import cubin_frame, cubin_loops

    try:
        loops, program = cubin_loops(kernel.asm["cubin"], kernel.metadata.num_warps, whole=True)
        frame = cubin_frame(kernel.asm["cubin"], kernel.metadata.num_warps)
    except Exception:  # no cubin (the interpreter) or no nvdisasm / cuobjdump run
        return {}
    return {} if loops is None else {"loops": loops, "program": program, **frame}


def _module(depth: int):
    return triton_deep if depth >= titans_kernels.DEEP_KERNEL_MIN_DEPTH else triton_kernels


def default_warps(shape) -> int:
    N, T, D, hidden, depth, C = shape
    return _module(depth)._launch_shape(D, hidden, C)["num_warps"]


@contextlib.contextmanager
def variant(shape, warps, any_depth: bool = False, form: str = "shipped", wave: int = 0):
    """Within the block, :func:`memtrain.kernels.titans.scan` launches the kernels at ``shape`` with
    ``num_warps=warps`` (None: the default); ``any_depth``: the any-depth kernels (:mod:`.triton_deep`, the state in
    memory) at depth 1-2 too; ``form``: the depth-1/2 kernels' form, one of :data:`FORMS` (``lean``:
    :data:`.triton_kernels.LEAN_BACKWARD`, ``split``: :data:`.triton_kernels.SPLIT_FORWARD` and
    :data:`.triton_kernels.SPLIT_BACKWARD`), set as a run sets it, through ``MEMTRAIN_TITANS_FORWARD`` and
    ``MEMTRAIN_TITANS_BACKWARD`` (:func:`memtrain.kernels.titans.kernel_form`); ``wave``: programs per launch of the
    one-program-per-sequence kernels (``MEMTRAIN_TITANS_WAVE``; 0: one launch). Yields the module whose kernels
    run."""
    if form not in FORMS:
        raise ValueError(f"unknown kernel form {form!r}; expected one of {', '.join(FORMS)}")
    N, T, D, hidden, depth, C = shape
    deep_from = titans_kernels.DEEP_KERNEL_MIN_DEPTH
    mod = triton_deep if any_depth else _module(depth)
    base = mod._launch_shape

    def launch(*a):
        opts = base(*a)
        if warps is not None:
            opts["num_warps"] = warps
        return opts

    mod._launch_shape = launch
    if any_depth:
        titans_kernels.DEEP_KERNEL_MIN_DEPTH = 1  # scan() picks the any-depth kernels at every depth
    try:
        with titans_kernels.kernel_form(form, wave):  # what a run picks them with (over the module's flags)
            yield mod
    finally:
        mod._launch_shape = base
        titans_kernels.DEEP_KERNEL_MIN_DEPTH = deep_from


FORMS = titans_kernels.FORMS  # the depth-1/2 kernels' forms (MEMTRAIN_TITANS_FORWARD / _BACKWARD / _STAGES)


def _forward(form: str) -> str:
    """The forward ``form`` runs (``shipped`` or ``split``), as :func:`memtrain.kernels.titans.form_env` sets it."""
    return titans_kernels.form_env(form)[titans_kernels.FORWARD_ENV]


def _split_backward(form: str) -> bool:
    """Whether ``form`` runs the split backward's kernels (the split and pipelined forms)."""
    return titans_kernels.form_env(form)[titans_kernels.BACKWARD_ENV] == "split"


def variants(name: str, warps: list[int], table: dict = SHAPES, waves: tuple[int, ...] = (),
             forms: Optional[tuple[str, ...]] = None) -> list[tuple]:
    """``(num_warps, any_depth, form, wave)`` of each launch the sweep times at shape ``name``, in order: the shipped
    one, the lean, split and pipelined forms, the shipped one in ``waves`` of programs (those below the shape's
    programs), the other ``warps``, the any-depth kernels (all but ``warps`` and ``waves`` at depth 1-2 only). ``wave``
    0: one launch. ``forms``: only those forms at the default launch, in that order (at depth 1-2)."""
    shallow = table[name][4] < titans_kernels.DEEP_KERNEL_MIN_DEPTH
    if forms is not None:
        return [(None, False, form, 0) for form in forms] if shallow else []
    out = [(None, False, "shipped", 0)]
    if shallow:  # the backward's other forms next, then the shipped one in waves
        out += [(None, False, "lean", 0), (None, False, "split", 0), (None, False, "pipelined", 0)]
        out += [(None, False, "shipped", wave) for wave in waves if wave < table[name][0]]
    out += [(w, False, "shipped", 0) for w in warps if w != default_warps(table[name])]
    if shallow:  # the any-depth kernels, default launch
        out.append((None, True, "shipped", 0))
    return out


def _scan_kernels(mod, form: str) -> dict:
    """The forward's and backward's kernels in ``mod`` under ``form``, by the names their records use."""
    if mod is triton_deep:
        return {"fwd": mod._fwd_deep_kernel, "bwd": mod._bwd_deep_kernel}
    if _split_backward(form):
        return {**{f"fwd_{part}": getattr(mod, f"_fwd_{part}_kernel") for part in ("advance", "read")},
                **{f"bwd_{part}": getattr(mod, f"_bwd_{part}_kernel") for part in ("recompute", "local", "carry")}}
    return {"fwd": mod._fwd_kernel, "bwd": mod._bwd_kernel}


def measure(shape, warps, device, repeats_ms: int, any_depth: bool = False, form: str = "shipped",
            wave: int = 0) -> tuple[dict, tuple]:
    """Time the kernels at ``shape`` under :func:`variant` ``(warps, any_depth, form, wave)``; the record and the
    outputs. The record counts the kernels the first call compiled and those Triton's cache held
    (``triton_compiled``, ``triton_cached``: a cache filled ahead of time, ``--precompile``, should hold them all)."""
    N, T, D, hidden, depth, C = shape
    default = (triton_deep if any_depth else _module(depth))._launch_shape(D, hidden, C)["num_warps"]
    q, k, v, lr, log_eta, log_keep, w, s = inputs(N, T, D, hidden, depth, device)
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
    with variant(shape, warps, any_depth, form, wave) as mod, compile_events() as events:
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
        first_events = list(events)
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
        stages = titans_kernels.requested_stages()
        info = {}
        for part, fn in _scan_kernels(mod, form).items():
            info.update({f"{part}_{k}": x for k, x in _compiled_info(fn).items()})
    shipped = mod is _module(depth)
    rec = {"N": N, "T": T, "head_dim": D, "hidden": hidden, "depth": depth, "chunk": C,
           "kernels": mod.__name__.rsplit(".", 1)[-1], "num_warps": warps or default, "backward": form,
           "forward": _forward(form), "stages": stages,
           "wave": wave or N, "launches": -(-N // (wave or N)),
           "default": shipped and (warps is None or warps == default) and form == "shipped" and not wave,
           "first_call_s": round(first_s, 2),
           "triton_compiled": [n for n, hit in first_events if not hit],
           "triton_cached": [n for n, hit in first_events if hit],
           "fwd_ms": round(fwd_ms, 4), "fwd_bwd_ms": round(fwd_bwd_ms, 4),
           # per chunk of every program, as docs/titans-kernels.md counts (the H200: 87 us for the shipped backward
           # at mag's shape): the call's time over its chunks (the backward's includes the gates')
           "fwd_us_per_chunk": round(fwd_ms * 1e3 / -(-T // C), 2),
           "bwd_us_per_chunk": round((fwd_bwd_ms - fwd_ms) * 1e3 / -(-T // C), 2),
           "fwd_tokens_per_s": round(N * T / fwd_ms * 1e3, 1), "fwd_bwd_tokens_per_s": round(N * T / fwd_bwd_ms * 1e3, 1),
           **info}
    return rec, (y.detach().float(), *(g.float() for g in grads))


# A recipe's block compiled ahead (--recipes): one block, and an FFN and vocabulary too small to cost CPU time (none of
# their kernels is ours); the Triton kernels on, as bf16 training on a GPU runs them.
RECIPE_BLOCK = ("model.n_layers=1", "model.ffn_dim=64", "model.vocab_size=1024", "data.tokenizer.vocab_size=1024",
                "model.titans.kernel=triton")


def recipe_block_step(path: str) -> None:
    """One forward and backward of one block of the Titans recipe ``path`` as training runs it on a GPU (inside
    :func:`memtrain.kernels.precompile.compile_only`, each Triton launch compiles instead): bf16, the recipe's
    micro-batch and sequence length, four documents per sequence (``train_throughput.py``'s synthetic batches), the
    Triton kernels, fused prologue, output stage, retrieval and RoPE (``RECIPE_BLOCK``). What compiles is what the
    recipe's first step compiles on the GPU besides the scan (the shapes' business): the chunk coefficients, the
    prologue, the output stage, MAC's retrieval and RoPE, each at the specialisations the recipe's tensors give. Tens
    of seconds of CPU each, at full length (at one block the keys did not depend on it: 1,024 tokens gave 4,096's)."""
    from memtrain.config import load_recipe
    from memtrain.model import anchor, build

    recipe = load_recipe(path, list(RECIPE_BLOCK))
    B, T = recipe.train.micro_batch_size, recipe.data.seq_len
    torch.manual_seed(0)
    model = build(recipe.model).to(torch.bfloat16)
    if recipe.train.loss_chunk_tokens:
        model.set_fused_loss(recipe.train.loss_chunk_tokens)
    x = torch.randint(0, recipe.model.vocab_size, (B, T))
    doc_ids = (torch.arange(T) * 4 // T).expand(B, T).contiguous()
    devices = anchor.FUSED_ROPE_DEVICES
    anchor.FUSED_ROPE_DEVICES = ("cpu", "cuda")  # apply_rope as on a GPU: the fused kernel
    try:
        model(x, doc_ids=doc_ids, labels=x.roll(-1, 1)).loss_sum.float().backward()
    finally:
        anchor.FUSED_ROPE_DEVICES = devices


def precompile(names: list[str], warps: list[int], cache_dir: str, target: str = "cuda:90",
               libtriton: Optional[str] = None, table: dict = SHAPES, recipes: tuple[str, ...] = ()) -> int:
    """Compile, for ``target`` and into the Triton cache ``cache_dir``, every kernel the sweep launches at the shapes
    ``names`` (each of :func:`variants`, forward and backward, the gates' backward included as training runs it),
    without a GPU and without launching anything (:func:`memtrain.kernels.precompile.compile_only`): the launches
    the recipes (shapes ``mac``, ``mag``), the layer benchmark (``layer``) and this sweep make on that GPU then find
    their binaries in the cache; then each Titans recipe of ``recipes`` (:func:`recipe_block_step`: the kernels around
    the scan, as the recipe launches them). Prints one JSON line per shape and variant and per recipe (kernels
    compiled, kernels already cached, seconds) and a summary."""
    from memtrain.kernels.precompile import cache_kernels, compile_only

    t_all = time.perf_counter()
    with compile_only(target, cache_dir, libtriton=libtriton) as report:
        for name in names:
            N, T, D, hidden, depth, C = table[name]
            shape = (2, 2 * C, D, hidden, depth, C)  # the lengths and batch are runtime integers: any will do
            for w, any_depth, form, _ in variants(name, warps, table):  # waves add no binary
                t0 = time.perf_counter()
                done = len(report.compiled), len(report.cached)
                q, k, v, lr, log_eta, log_keep, ws, ss = inputs(*shape[:5], torch.device("cpu"), half=torch.bfloat16)
                leaves = [x.detach().requires_grad_(True) for x in (q, k, v, lr, log_eta, log_keep)]
                with variant(shape, w, any_depth, form):
                    y = titans_kernels.scan(*leaves, ws, ss, ws, 0, C, kernel="triton")[0]
                    torch.autograd.grad(y.float().square().sum(), leaves)
                print(json.dumps({"shape": name, "num_warps": w or default_warps(table[name]), "any_depth": any_depth,
                                  "backward": form, "compiled": report.compiled[done[0]:],
                                  "cached": report.cached[done[1]:], "seconds": round(time.perf_counter() - t0, 1)}),
                      flush=True)
        for path in recipes:
            t0 = time.perf_counter()
            done = len(report.compiled), len(report.cached)
            recipe_block_step(path)
            print(json.dumps({"recipe": path, "compiled": report.compiled[done[0]:], "cached": report.cached[done[1]:],
                              "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    summary = {"precompiled": True, "target": report.target, "cache_dir": report.cache_dir,
               "triton": report.triton_version, "triton_key": report.triton_key, "backend": report.backend,
               "shapes": names, "recipes": list(recipes),
               "compiled": len(report.compiled), "cached": len(report.cached),
               "kernels_in_cache": len(cache_kernels(cache_dir)), "seconds": round(time.perf_counter() - t_all, 1)}
    (Path(cache_dir) / "precompiled.json").write_text(json.dumps(summary) + "\n")  # beside the entries, for the GPU
    print(json.dumps(summary), flush=True)
    return 0


def _compile(spec: tuple) -> dict:
    from memtrain.kernels.titans.aot import compile_kernel

    kernel, shape, warps, any_depth, form = spec
    N, T, D, hidden, depth, C = shape
    try:
        return compile_kernel(kernel, depth, D, hidden, C, num_warps=warps, any_depth=any_depth, lean=form == "lean",
                              stages=int(titans_kernels.form_env(form)[titans_kernels.STAGES_ENV]))
    except Exception as e:  # one launch that fails to compile must not end the table
        return {"kernel": kernel, "error": f"{type(e).__name__}: {e}"[:500]}


def static(warps: list[int], names: list[str], table: dict = SHAPES) -> int:
    """``--static``: each shape's kernels compiled for sm_90 under each launch, one JSON line per shape, kernels
    (register-resident or any-depth), ``num_warps`` and form (``backward``, ``forward``), with the forward's and
    backward's (the split and pipelined forms' five: ``fwd_advance``, ``fwd_read``, ``bwd_recompute``, ``bwd_local``,
    ``bwd_carry``) registers, spills, shared memory, stack frames, innermost loops (instructions and local-memory
    loads, stores and bytes per iteration and thread: the spills that run per chunk;
    :func:`memtrain.kernels.titans.aot.sass_loops`) and whole-kernel figures (``program``: what the split form's
    per-chunk kernels, which have no loop, run per chunk). The compiles run in parallel (one process per core)."""
    import multiprocessing

    rows = []
    for name in names:
        shape = table[name]
        depth = shape[4]
        variants = [(depth >= titans_kernels.DEEP_KERNEL_MIN_DEPTH, w, "shipped")
                    for w in dict.fromkeys([default_warps(shape), *warps])]
        if depth < titans_kernels.DEEP_KERNEL_MIN_DEPTH:  # the other backwards, the any-depth kernels: default warps
            variants += [(False, None, "lean"), (False, None, "split"), (False, None, "pipelined"),
                         (True, None, "shipped")]
        rows += [(name, shape, any_depth, w, form) for any_depth, w, form in variants]

    def kernels(form):
        return (("fwd_advance", "fwd_read", "bwd_recompute", "bwd_local", "bwd_carry") if _split_backward(form) else
                ("fwd", "bwd"))

    # a compiled kernel depends on the widths, depth and chunk, not on N or T (mac and mag share theirs); the
    # forward has one form, and the pipelined form differs from the split one in its loops only
    def key(kernel, shape, any_depth, w, form):
        own = kernel == "bwd" or (form == "pipelined" and kernel in triton_kernels.PIPELINED_KERNELS)
        return kernel, shape[2:], w, any_depth, form if own else "shipped"

    specs = {}
    for _, shape, any_depth, w, form in rows:
        for kernel in kernels(form):
            k = key(kernel, shape, any_depth, w, form)
            specs[k] = (kernel, shape, w, any_depth, k[-1])
    todo = sorted(specs, key=lambda k: k[0] == "fwd")  # the slow backwards first
    with multiprocessing.get_context("fork").Pool(os.cpu_count() or 1) as pool:
        compiled = dict(zip(todo, pool.map(_compile, [specs[k] for k in todo], chunksize=1)))
    failed = 0
    for name, shape, any_depth, w, form in rows:
        rec = {"shape": name, "device": "sm_90 (compiled ahead of time, not run)", "N": shape[0], "T": shape[1],
               "head_dim": shape[2], "hidden": shape[3], "depth": shape[4], "chunk": shape[5],
               "kernels": "triton_deep" if any_depth else "triton_kernels", "backward": form,
               "forward": _forward(form)}
        for r in (compiled[key(kernel, shape, any_depth, w, form)] for kernel in kernels(form)):
            if "error" in r:
                rec[f"{r['kernel']}_error"] = r["error"]
                failed += 1
                continue
            rec["num_warps"] = r["num_warps"]
            rec.update({f"{r['kernel']}_{k}": r.get(k) for k in ("num_stages", "registers", "spill_stores",
                                                                 "spill_loads", "shared", "stack_frame",
                                                                 "frame_kib_per_program", "loops", "program")})
        mod = triton_deep if any_depth else triton_kernels
        shipped = any_depth == (shape[4] >= titans_kernels.DEEP_KERNEL_MIN_DEPTH) and form == "shipped"
        rec["default"] = shipped and (w is None or w == mod._launch_shape(shape[2], shape[3], shape[5])["num_warps"])
        print(json.dumps(rec), flush=True)
    return 1 if failed else 0


def _rel(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=None, help=f"comma-separated, of {', '.join(SHAPES)} (default: all)")
    ap.add_argument("--warps", default="4,8,16", help="num_warps variants besides the default (comma-separated)")
    ap.add_argument("--waves", default="",
                    help="programs per launch to time the shipped kernels in (MEMTRAIN_TITANS_WAVE; comma-separated "
                         "multiples of 8, those below a shape's programs, e.g. 16,32; default: none)")
    ap.add_argument("--forms", default=None,
                    help="comma-separated forms of " + ", ".join(FORMS) + " to time alone, at the default launch "
                         "(default: the whole sweep)")
    ap.add_argument("--rep-ms", type=int, default=200, help="do_bench's repetition time per measurement")
    ap.add_argument("--interpret", action="store_true", help="CPU smoke run at tiny shapes (TRITON_INTERPRET=1)")
    ap.add_argument("--static", action="store_true",
                    help="no GPU needed: compile for sm_90 and report registers, spills and shared memory, untimed")
    ap.add_argument("--tiny", action="store_true", help="with --static: the tiny shapes of --interpret (a quick check)")
    ap.add_argument("--precompile", metavar="CACHE_DIR", default=None,
                    help="no GPU needed: compile every launch the sweep makes at --shapes for --target into this "
                         "Triton cache directory, launching nothing")
    ap.add_argument("--recipes", default="",
                    help="with --precompile: comma-separated Titans recipe files whose kernels around the scan (chunk "
                         "coefficients, fused prologue, output stage, retrieval, RoPE) to compile as their training "
                         "launches them")
    ap.add_argument("--cache-figures", metavar="CACHE_DIR", default=None,
                    help="no GPU needed: the figures (registers, shared memory, stack frame, loops) of every kernel "
                         "binary in this Triton cache directory, one JSON line each")
    ap.add_argument("--target", default="cuda:90", help="with --precompile: the GPU (default cuda:90, H100 / H200)")
    ap.add_argument("--libtriton-from", metavar="WHEEL", default=None,
                    help="with --precompile: the GPU machine's Triton wheel (this Triton's version, for its Python): "
                         "the cache keys that build computes")
    args = ap.parse_args()
    if args.cache_figures:
        from memtrain.kernels.titans.aot import cache_figures

        if not Path(args.cache_figures).is_dir():
            ap.error(f"--cache-figures {args.cache_figures}: no such directory; pass a Triton cache directory such as "
                     ".gpu/triton-cache (tools/gpu_check.py --prepare writes it)")
        try:
            rows = cache_figures(args.cache_figures)
        except ValueError as e:
            ap.error(f"--cache-figures: {e}")
        if not rows:
            ap.error(f"--cache-figures {args.cache_figures}: no compiled kernel (<name>.cubin) in it")
        for row in rows:
            print(json.dumps(row))
        return 0
    table = TINY if args.interpret or args.tiny else SHAPES
    names = args.shapes.split(",") if args.shapes else list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        ap.error(f"unknown shape(s) {', '.join(unknown)}; choose from {', '.join(table)}")
    warps = [int(x) for x in args.warps.split(",") if x.strip()]
    forms = None if args.forms is None else tuple(f.strip() for f in args.forms.split(",") if f.strip())
    if forms is not None and (not forms or any(f not in FORMS for f in forms)):
        ap.error(f"--forms {args.forms!r}: expected forms of {', '.join(FORMS)}, comma-separated")
    try:
        waves = tuple(int(x) for x in args.waves.split(",") if x.strip())
    except ValueError:
        waves = (-1,)
    if any(w <= 0 or w % titans_kernels.WAVE_MULTIPLE for w in waves):
        ap.error(f"--waves {args.waves!r}: expected positive multiples of {titans_kernels.WAVE_MULTIPLE}, "
                 "comma-separated")
    if args.static or args.precompile:
        if os.environ.get("TRITON_INTERPRET") == "1":
            ap.error(f"{'--static' if args.static else '--precompile'} compiles for a GPU: unset TRITON_INTERPRET")
        if args.static:
            return static(warps, names, table)
        from memtrain.kernels.precompile import libtriton_digest, parse_target

        try:
            parse_target(args.target)
            libtriton = libtriton_digest(args.libtriton_from) if args.libtriton_from else None
        except (ValueError, OSError) as e:
            ap.error(str(e))
        recipes = tuple(r for r in args.recipes.split(",") if r.strip())
        from memtrain.config import load_recipe
        from memtrain.errors import MemtrainError

        for path in recipes:  # each checked before minutes of compiling
            try:
                kind = load_recipe(path, list(RECIPE_BLOCK)).model.type
            except MemtrainError as e:
                ap.error(f"--recipes: {e}")
            if kind != "titans":
                ap.error(f"--recipes: {path} has model.type {kind!r}; it takes Titans recipes")
        return precompile(names, warps, args.precompile, args.target, libtriton, table, recipes)
    if args.interpret:
        if os.environ.get("TRITON_INTERPRET") != "1":
            ap.error("--interpret needs TRITON_INTERPRET=1 in the environment (set before Triton is imported)")
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        ap.error("no CUDA device: the kernels are timed on a GPU (or pass --interpret for a CPU smoke run)")
    else:
        device = torch.device("cuda")
    for name in names:
        ref = None
        for warp, any_depth, form, wave in variants(name, warps, table, waves, forms):
            try:
                rec, outs = measure(table[name], warp, device, args.rep_ms, any_depth, form, wave)
            except Exception as e:  # one variant that fails to compile or launch must not end the sweep
                print(json.dumps({"shape": name, "num_warps": warp, "any_depth": any_depth, "backward": form,
                                  "wave": wave, "error": f"{type(e).__name__}: {e}"[:500]}), flush=True)
                continue
            if ref is None:
                ref = outs
            rec["max_rel_err_vs_default"] = max(_rel(a, b) for a, b in zip(outs, ref))
            print(json.dumps({"shape": name, "device": torch.cuda.get_device_name() if device.type == "cuda"
                              else "cpu (interpreter)", **rec}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
