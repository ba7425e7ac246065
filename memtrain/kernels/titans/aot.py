"""The Titans kernels compiled ahead of time for a GPU architecture, on any machine (no GPU needed: Triton's own
``ptxas``): the shared memory, registers and spilled bytes of each kernel at a given shape and launch, as the
GPU would run it. What :func:`compile_kernel` reports is what ``ptxas -v`` prints for the compiled PTX, with the
arguments specialised as a launch specialises them (the scan's binaries are the launches' own, byte for byte);
:func:`cache_figures` reads the same figures from the binaries in a Triton cache, which the launches compiled.

Why. The scan kernels keep the memory's state (weights and momentum of each layer, float32) in registers for a
whole call, one program per (sequence, head): at head size 64 and hidden width 128 that is 128 KB per program for
the forward and more for the backward, which also carries the state's gradients -- against 256 KB of registers
per SM. Spilled registers go to local memory inside the loop over chunks, so spills are the first thing to read
about a launch; ``benchmarks/titans_kernels.py --static`` tabulates them for the recipes' shapes, and
tests/test_titans_kernel.py checks the shared memory against an H100's limit and the chunk coefficients' spills.

    from memtrain.kernels.titans.aot import compile_kernel
    compile_kernel("bwd", depth=2, head_dim=64, hidden=128, chunk=16)
    # {'kernel': 'bwd', 'depth': 2, ..., 'num_warps': 8, 'shared': 61440, 'registers': 255, 'spill_stores': ...,
    #  'loops': [{'instructions': 1758, 'local_loads': 376, 'local_stores': 256, ...}, ...]}

ptxas's spill figures count spill instructions once, wherever they are in the code. What a spill costs is how often
it runs: ``loops`` reads the compiled code itself (SASS, disassembled with Triton's own ``nvdisasm``) and gives,
for each innermost loop, its instructions and the local-memory loads and stores among them -- what every thread
executes per iteration (for the scan kernels, per chunk). Spilled registers live in local memory, which the L1
cache holds only in part: the depth-2 backward's stack frame is 3.8 KB per thread at the recipes' shapes (Triton
3.8; 3.9 KB under 3.6), about 1 MB for its 256 threads, against an SM's 256 KB of L1 and shared memory together;
so ``local_kib_per_program`` (what one iteration's spills move for the whole program) is mostly traffic to L2, and
to HBM where the frames of all running programs together exceed the L2 (50 MB on an H100 / H200): 64 programs of
that backward keep 62 MiB live. :func:`cubin_frame` reads a kernel's frame.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import subprocess
import tempfile
from typing import Optional

KERNELS = ("fwd", "bwd", "fwd_advance", "fwd_read", "bwd_recompute", "bwd_local", "bwd_carry", "coef_fwd", "coef_bwd",
           "qkv_fwd", "qkv_bwd", "conv_qkv_fwd", "conv_qkv_bwd", "conv_queries_fwd", "conv_queries_bwd", "conv_grad",
           "gates_fwd", "gates_bwd", "out_fwd", "out_bwd", "rope_fwd", "rope_bwd", "read_fwd", "read_bwd")
# The scan kernels' integer arguments; every other non-constexpr argument is a pointer.
_INTS = {"NC", "Tp", "N_LAST", "SAVE_EVERY", "NSAVE", "C", "D", "H1", "grp", "c0", "c1"}
_HALF = {"Q", "K", "V"}  # q, k, v reach the kernels in the activations' half precision in training
_PTXAS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads.*?Used (\d+) registers", re.S)


def _ptxas_figures(log: str) -> dict:
    m = _PTXAS.search(log)
    if m is None:
        raise RuntimeError(f"no register / spill figures in the ptxas log:\n{log[-2000:]}")
    return {"registers": int(m.group(3)), "spill_stores": int(m.group(1)), "spill_loads": int(m.group(2))}


_SASS_ADDR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*)")
_SASS_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_SASS_BRANCH = re.compile(r"\bBRA\b\W*(\.L_x_\d+)")
_SASS_LOCAL_LOAD = re.compile(r"\bLDL\b")
_SASS_LOCAL_STORE = re.compile(r"\bSTL\b")
# a local access's width: ``LDL.64``, ``STL.128``, ``LDL.U8`` ...; none (or only ``.LU``) is 32 bits
_SASS_LOCAL_WIDTH = re.compile(r"\b(?:LDL|STL)((?:\.[A-Z0-9]+)*)")
_SASS_WIDTH_BYTES = {"8": 1, "U8": 1, "S8": 1, "16": 2, "U16": 2, "S16": 2, "32": 4, "64": 8, "128": 16}
_SASS_SHARED = re.compile(r"\b(?:LDS|STS|LDSM|STSM)\b")
_SASS_BARRIER = re.compile(r"\bBAR\b")
_SASS_MMA = re.compile(r"\b(?:HMMA|HGMMA)\b")


def _local_bytes(text: str) -> int:
    """Bytes one thread moves with a local-memory access instruction (0 for any other)."""
    m = _SASS_LOCAL_WIDTH.search(text)
    if m is None:
        return 0
    widths = [_SASS_WIDTH_BYTES[x] for x in m.group(1).split(".") if x in _SASS_WIDTH_BYTES]
    return widths[0] if widths else 4


def sass_loops(sass: str) -> list[dict]:
    """The innermost loops of a kernel's SASS (``nvdisasm -c`` text), in code order: every back edge (a branch to a
    label at or before it) closes a loop from that label to the branch, and a loop that holds no other is innermost
    (a loop of one instruction, the trap at a kernel's end, is not counted). For each: ``instructions`` and the
    local-memory ``local_loads`` (``LDL``) and ``local_stores`` (``STL``) among them: spilled registers, executed by
    every thread in every iteration; ``local_bytes``, what those move per thread (``LDL.64`` 8 bytes, ``STL.128``
    16, no width 4); ``shared`` (shared-memory loads and stores, ``LDS``, ``STS``, ``LDSM``, ``STSM``: layout
    conversions and dot operands), ``barriers`` (``BAR``) and ``mma`` (tensor-core instructions, ``HMMA`` /
    ``HGMMA``)."""
    labels, code, pending = {}, [], []
    for line in sass.splitlines():
        m = _SASS_LABEL.match(line)
        if m:
            pending.append(m.group(1))
            continue
        m = _SASS_ADDR.search(line)
        if m:
            addr = int(m.group(1), 16)
            labels.update((name, addr) for name in pending)
            pending = []
            code.append((addr, m.group(2)))
    spans = []
    for addr, text in code:
        m = _SASS_BRANCH.search(text)
        if m and m.group(1) in labels and labels[m.group(1)] < addr:
            spans.append((labels[m.group(1)], addr))
    inner = [(lo, hi) for lo, hi in spans if not any((a, b) != (lo, hi) and lo <= a and b <= hi for a, b in spans)]
    return [_figures([text for addr, text in code if lo <= addr <= hi]) for lo, hi in sorted(set(inner))]


def _figures(body: list[str]) -> dict:
    """:func:`sass_loops`' figures of a list of SASS instructions."""
    return {"instructions": len(body), "local_loads": sum(bool(_SASS_LOCAL_LOAD.search(t)) for t in body),
            "local_stores": sum(bool(_SASS_LOCAL_STORE.search(t)) for t in body),
            "local_bytes": sum(_local_bytes(t) for t in body),
            "shared": sum(bool(_SASS_SHARED.search(t)) for t in body),
            "barriers": sum(bool(_SASS_BARRIER.search(t)) for t in body),
            "mma": sum(bool(_SASS_MMA.search(t)) for t in body)}


def sass_program(sass: str) -> dict:
    """:func:`sass_loops`' figures for the whole kernel, each instruction counted once (what one program of a
    kernel without loops executes)."""
    return _figures([m.group(2) for m in map(_SASS_ADDR.search, sass.splitlines()) if m])


def cubin_loops(cubin: bytes, num_warps: int, whole: bool = False):
    """:func:`sass_loops` of a compiled kernel launched with ``num_warps``, each loop with its
    ``local_kib_per_program`` (the local bytes one iteration moves per thread, times the program's threads); None
    where Triton ships no ``nvdisasm``. ``whole``: ``(loops, program)``, with :func:`sass_program`'s figures."""
    sass = _sass(cubin)
    if sass is None:
        return (None, None) if whole else None
    loops, program = sass_loops(sass), sass_program(sass)
    for fig in (*loops, program):
        fig["local_kib_per_program"] = round(fig["local_bytes"] * 32 * num_warps / 1024, 1)
    return (loops, program) if whole else loops


def _run_tool(name: str, args: list[str], cubin: bytes) -> Optional[str]:
    """What Triton's own CUDA tool ``name`` (``nvdisasm``, ``cuobjdump``) prints for ``cubin``, or None where
    Triton ships no such tool."""
    import triton.backends.nvidia as nvidia

    tool = os.path.join(os.path.dirname(nvidia.__file__), "bin", name)
    if not os.access(tool, os.X_OK):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return subprocess.run([tool, *args, path], capture_output=True, text=True, check=True, timeout=300).stdout


def _sass(cubin: bytes) -> Optional[str]:
    """A compiled kernel's SASS (``nvdisasm -c``), or None where Triton ships no ``nvdisasm``."""
    return _run_tool("nvdisasm", ["-c"], cubin)


def _res_usage(cubin: bytes) -> Optional[str]:
    """A compiled kernel's resource usage (``cuobjdump -res-usage``), or None where Triton ships no ``cuobjdump``."""
    return _run_tool("cuobjdump", ["-res-usage"], cubin)


_RES_STACK = re.compile(r"\bSTACK:(\d+)")


def stack_frame(res_usage: str) -> Optional[int]:
    """The stack frame (bytes per thread: the spilled registers' home in local memory) in ``cuobjdump -res-usage``'s
    report of one kernel (``REG:255 STACK:4136 SHARED:0 LOCAL:0 ...``), None if it names none."""
    m = _RES_STACK.search(res_usage)
    return int(m.group(1)) if m else None


def cubin_frame(cubin: bytes, num_warps: int) -> dict:
    """A compiled kernel's stack frame: ``stack_frame`` (bytes per thread, :func:`stack_frame`) and
    ``frame_kib_per_program`` (times the program's threads: the local memory one running program keeps live, which
    the SM's L1 holds only in part and the GPU's L2 holds for every running program only while their sum fits it);
    empty where Triton ships no ``cuobjdump``."""
    frame = stack_frame(_res_usage(cubin) or "")
    if frame is None:
        return {}
    return {"stack_frame": frame, "frame_kib_per_program": round(frame * 32 * num_warps / 1024, 1)}


_RES_REG = re.compile(r"\bREG:(\d+)")


def cache_figures(cache_dir) -> list[dict]:
    """The figures of every kernel binary in a Triton cache directory (its entries as
    :func:`memtrain.kernels.precompile.cache_kernels` lists them, with a ``<name>.cubin``): the binaries the
    launches themselves compiled -- on a GPU, or ahead of time by :mod:`memtrain.kernels.precompile`
    (``tools/gpu_check.py --prepare``, ``benchmarks/titans_kernels.py --precompile``) -- so exact for every kernel
    as launched, where :func:`compile_kernel` leaves the lengths and strides of the kernels around the scan
    unspecialised. A corrupted entry raises one ValueError naming it. Per binary, sorted by kernel, warps and entry:
    ``entry``, ``kernel`` (the function's name), ``num_warps``, ``shared``, ``registers`` (``cuobjdump
    -res-usage``), ``stack_frame`` and ``frame_kib_per_program`` (:func:`cubin_frame`), ``loops`` and ``program``
    (:func:`cubin_loops`); without Triton's CUDA tools, the figures they give are absent or None."""
    import json
    from pathlib import Path

    from memtrain.kernels.precompile import cache_kernels

    rows = []
    for entry, name in cache_kernels(cache_dir).items():
        cubin = Path(cache_dir) / entry / f"{name}.cubin"
        try:
            meta = json.loads(cubin.with_suffix(".json").read_text())
            binary = cubin.read_bytes()
            warps = meta["num_warps"]
            reg = _RES_REG.search(_res_usage(binary) or "")
            loops, program = cubin_loops(binary, warps, whole=True)
            frame = cubin_frame(binary, warps)
        except (OSError, ValueError, KeyError, subprocess.CalledProcessError) as e:
            raise ValueError(f"{cubin.parent}: not a readable Triton cache entry for {name} ({type(e).__name__}); "
                             "delete it, or compile it again (benchmarks/titans_kernels.py --precompile)") from None
        rows.append({"entry": entry, "kernel": meta["name"], "num_warps": warps, "shared": meta["shared"],
                     "registers": int(reg.group(1)) if reg else None, **frame, "loops": loops, "program": program})
    return sorted(rows, key=lambda r: (r["kernel"], r["num_warps"], r["entry"]))


_TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _launch_specialization(fn, sig: dict, consts: dict, ints: dict, target) -> dict:
    """Specialise ``sig`` as Triton's JIT specialises a launch's arguments, with Triton's own function for it
    (``native_specialize_impl``, what every launch calls): a pointer is 16-byte aligned (every launch's tensors
    are: a fresh allocation, or a view at such an offset -- the launches' caches show every pointer aligned), an
    integer whose value ``ints`` gives is divisible by 16 or equal to 1 (then a constant) as the JIT finds it,
    unless the kernel leaves it unspecialised (``do_not_specialize``). Integers ``ints`` does not give stay
    unspecialised. Updates ``sig`` and ``consts`` in place (an integer equal to 1 becomes a constexpr) and returns
    the attributes for :class:`triton.compiler.ASTSource`. Without this, :func:`compile_kernel` compiled every
    pointer as unaligned and every integer as unknown: scalar instead of 128-bit loads, and (the split backward's
    carried loop at the recipes' shapes, Triton 3.6) 5,539 instructions per chunk against the launch's 3,801."""
    import torch
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import native_specialize_impl

    backend = make_backend(target)
    attrs = {}
    for i, param in enumerate(fn.params):
        name, ty = param.name, sig[param.name]
        if ty == "constexpr":
            continue
        if ty.startswith("*"):
            value = torch.empty(1, dtype=getattr(torch, _TORCH_DTYPES[ty[1:]]))
        elif name in ints:
            value = ints[name]
        else:
            continue
        kind, spec = native_specialize_impl(backend, value, False, not param.do_not_specialize,
                                            not param.do_not_specialize_on_alignment)
        if kind == "constexpr":
            sig[name], consts[name] = "constexpr", spec
        elif spec:
            attrs[(i,)] = backend.parse_attr(spec)
    return attrs


def compile_kernel(kernel: str, depth: int = 2, head_dim: int = 64, hidden: int = 128, chunk: int = 16, *,
                   num_warps: Optional[int] = None, arch: int = 90, half: str = "bf16",
                   any_depth: Optional[bool] = None, lean: bool = False, num_ctas: int = 1,
                   stages: Optional[int] = None) -> dict:
    """Compile one Titans kernel for ``sm_<arch>`` and report it: ``kernel`` one of :data:`KERNELS` (the scan's
    forward / backward at ``depth`` -- the register-resident pair at depth 1-2, the any-depth pair at 3+ or where
    ``any_depth`` -- the split backward's three kernels at depth 1-2 (``bwd_recompute``, ``bwd_local``,
    ``bwd_carry``: :data:`memtrain.kernels.titans.triton_kernels.SPLIT_BACKWARD`), the split forward's two
    (``fwd_advance``, ``fwd_read``: :data:`~memtrain.kernels.titans.triton_kernels.SPLIT_FORWARD`), the chunk
    coefficients' at ``chunk``, the layer's prologue, q/k/v at ``head_dim`` (``conv_qkv_*`` with the width-4
    convolution before them, ``conv_queries_*`` MAC's retrieval queries with it, ``conv_grad`` the convolution's weight
    and bias gradients' sum) and the gates for up to 21 heads, its output stage at ``head_dim``, RoPE's pair at
    ``head_dim``, or MAC's retrieval at ``depth``, ``head_dim`` and ``hidden``, ``half`` its products' operands),
    ``head_dim`` and ``hidden`` (the memory's widths), ``num_warps`` (default: what the kernels launch with),
    ``half`` the dtype of q / k / v (``bf16``, ``fp16`` or ``fp32``), ``lean`` the depth-1/2 backward's lean form
    (:data:`memtrain.kernels.titans.triton_kernels.LEAN_BACKWARD`, compiled without the chunk weights' gradient),
    ``num_ctas`` Triton's Hopper cluster option (each program's tiles spread over that many SMs; no kernel launches
    with more than 1 -- docs/titans-kernels.md, "One program's state over several SMs"), ``stages`` the split loops'
    pipelining stages as ``MEMTRAIN_TITANS_STAGES`` sets them (default: the environment's, as a launch reads it; the
    kernel's ``num_stages`` is :func:`memtrain.kernels.titans.triton_kernels.loop_stages`).
    Returns the arguments with ``shared`` (bytes per program), ``registers`` (per thread), ``spill_stores`` and
    ``spill_loads`` (bytes of spill instructions in the compiled code, per thread), ``stack_frame`` and
    ``frame_kib_per_program`` (the local memory the spills live in, per thread and per program,
    :func:`cubin_frame`; absent without ``cuobjdump``) and ``loops`` (each innermost
    loop's instructions, local-memory loads and stores and their bytes, shared-memory accesses, barriers and
    tensor-core instructions per iteration and thread, :func:`sass_loops`, and ``local_kib_per_program``: the
    local bytes times the program's threads; None without ``nvdisasm``) and ``program`` (the same figures for the
    whole kernel, each instruction once: what one program of a kernel without loops runs) and ``cubin_sha256``.

    The arguments are specialised as a launch's (:func:`_launch_specialization`): pointers 16-byte aligned and the
    integers the memory's widths fix (the scan's and the coefficients' ``C``, ``D``, ``H1``; the read's ``D``,
    ``H1``; the prologue's and output stage's ``HD``; RoPE's ``HALF``) divisible by 16 where they are, so the scan
    and coefficient kernels compile to the launch's own binary, byte for byte (tests/test_precompile.py compares
    them). The other kernels' lengths and strides vary by call and stay unspecialised here, where a launch makes a
    unit stride a constant: their figures are for a more general binary than the one a GPU runs."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from memtrain.kernels.titans import DEEP_KERNEL_MIN_DEPTH, triton_deep, triton_kernels as tk

    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {', '.join(KERNELS)}")
    ints: dict = {}  # the integer arguments a model's widths fix (lengths and strides vary by call)
    if kernel.startswith("rope"):  # memtrain.kernels.rope (every model's RoPE; MAC's retrieved keys): float32 tables
        from memtrain.kernels import rope
        from memtrain.kernels.launch import block

        fn = rope._rope_kernel
        ptr = {"fp32": "*fp32", "bf16": "*bf16", "fp16": "*fp16"}[half]
        consts = dict(INVERSE=kernel == "rope_bwd", BT=rope.BLOCK_T, BD=block(head_dim // 2))
        ints = {"HALF": head_dim // 2}
        typed = {"X": ptr, "Y": ptr, "COS": "*fp32", "SIN": "*fp32"}
        launch = {"num_warps": num_warps or 4, "num_stages": 3}  # Triton's defaults, as the kernel launches
        sig = {n: "constexpr" if n in consts else typed.get(n, "i32") for n in fn.arg_names}
        scan = False
    elif kernel.startswith("out"):  # the layer's output stage (memtrain.kernels.titans.output): float32 retrievals
        from memtrain.kernels.titans import output, prologue

        fn = getattr(output, f"_{kernel}_kernel")
        ptr = {"fp32": "*fp32", "bf16": "*bf16", "fp16": "*fp16"}[half]
        consts = dict(BT=prologue.BLOCK_T, BD=prologue._block(head_dim))
        ints = {"HD": head_dim}
        typed = {"Y": "*fp32", "DY": "*fp32", "W": ptr, "G": ptr, "Z": ptr, "DZ": ptr, "DG": ptr, "DW": "*fp32",
                 "eps": "fp32"}
        launch = {"num_warps": num_warps or 4, "num_stages": 3}  # Triton's defaults, as the kernels launch
        sig = {n: "constexpr" if n in consts else typed.get(n, "i32") for n in fn.arg_names}
        scan = False
    elif kernel.startswith(("qkv", "conv", "gates")):  # the prologue (memtrain.kernels.titans.prologue): 12 heads
        from memtrain.kernels.titans import prologue  # of head_dim; the convolution's width 4 (every recipe's)

        way = kernel.rsplit("_", 1)[-1]
        fn = getattr(prologue, "_conv_grad_kernel" if kernel == "conv_grad" else
                     f"_gates_{way}_kernel" if kernel.startswith("gates") else f"_qkv_{way}_kernel")
        ptr = {"fp32": "*fp32", "bf16": "*bf16", "fp16": "*fp16"}[half]
        if kernel == "conv_grad":
            consts = dict(CONV_K=4, BC=prologue.CONV_GRAD_BLOCK)
            typed = {"PW": "*fp32", "DW": ptr, "DB": ptr}
        elif not kernel.startswith("gates"):  # q/k/v; MAC's retrieval queries (float32 out, no cache)
            conv_k = 4 if kernel.startswith("conv") else 0
            queries = kernel.startswith("conv_queries")
            consts = dict(NORM_V=True, CONV_K=conv_k, PARTS=1 if queries else 3,
                          NEW_CACHE=kernel.startswith("conv_qkv"), BT=prologue.BLOCK_T, BD=prologue._block(head_dim),
                          **({"PAD": max(conv_k - 1, 0)} if way == "bwd" else {}))
            typed = {n: ptr for n in ("X", "DX", "CACHE", "DCACHE", "W", "BIAS", "NEWC", "DNEWC")}
            typed.update({n: "*fp32" if queries else ptr for n in ("Q", "K", "V", "DQ", "DK", "DV")})
            typed["PW"] = "*fp32"
            ints = {"HD": head_dim}
        else:
            consts = dict(BT=prologue.BLOCK_T, BG=prologue._block(3 * 12))
            typed = {"G": ptr, "DG": ptr, "max_lr": "fp32", "log_max_momentum": "fp32",
                     **{n: "*fp32" for n in ("LR", "LOG_ETA", "LOG_KEEP", "DLR", "DLOG_ETA", "DLOG_KEEP")}}
        conv_bwd = kernel.startswith("conv_q") and way == "bwd"  # 8 warps, the rest Triton's defaults, as launched
        launch = {"num_warps": num_warps or (prologue.CONV_BWD_WARPS if conv_bwd else 4), "num_stages": 3}
        sig = {n: "constexpr" if n in consts else typed.get(n, "i32") for n in fn.arg_names}
        scan = False
    elif kernel.startswith("read_"):  # MAC's retrieval (memtrain.kernels.titans.read): float32 queries and weights,
        from memtrain.kernels.titans import read  # ``half`` the products' operands

        fn = getattr(read, f"_{kernel}_kernel")
        consts = dict(DEPTH=depth, DOT={"fp32": 0, "bf16": 1, "fp16": 2}[half], BT=read.BLOCK_T,
                      BD=read._block(head_dim), BH=read._block(hidden))
        launch = {"num_warps": num_warps or (read.BWD_WARPS if kernel == "read_bwd" else 4), "num_stages": 3}
        ints = {"D": head_dim, "H1": hidden}
        ptrs = {"Q", "W1", "W2", "Y", "DY", "DQ", "DW1", "DW2"}
        sig = {n: "constexpr" if n in consts else "*fp32" if n in ptrs else "i32" for n in fn.arg_names}
        scan = False
    elif kernel.startswith("coef"):  # float32 gates in, one program per chunk
        fn = tk._coef_fwd_kernel if kernel == "coef_fwd" else tk._coef_bwd_kernel
        consts = tk._coef_launch(chunk)
        shipped = consts.pop("num_warps")
        launch = {"num_warps": num_warps or shipped, "num_stages": 3}  # Triton's default stages
        sig = {n: "constexpr" if n in consts else "i32" if n == "C" else "*fp32" for n in fn.arg_names}
        ints = {"C": chunk}
        scan = False
    else:
        deep = depth >= DEEP_KERNEL_MIN_DEPTH if any_depth is None else any_depth
        if deep and kernel not in ("fwd", "bwd"):
            raise ValueError(f"the split forward and backward ({kernel!r}) are the depth-1/2 kernels' only; got depth "
                             f"{depth}{' with any_depth' if any_depth else ''}")
        mod = triton_deep if deep else tk
        fn = getattr(mod, f"_{kernel}_deep_kernel" if deep else f"_{kernel}_kernel")
        consts = mod._launch_shape(head_dim, hidden, chunk)
        launch = {k: consts.pop(k) for k in ("num_warps", "num_stages")}
        if num_warps:
            launch["num_warps"] = num_warps
        if not deep:  # the split loops, pipelined where MEMTRAIN_TITANS_STAGES asks for it and they fit
            launch["num_stages"] = tk.loop_stages(kernel, head_dim, hidden, chunk, stages)
        dot = {"fp32": 0, "bf16": 1, "fp16": 2}[half]
        consts.update(DOT=dot, DEPTH=depth)
        if "LEAN" in fn.arg_names:  # the depth-1/2 backward's form (triton_kernels.LEAN_BACKWARD); the lean one as
            consts.update(LEAN=lean, HAS_WG=not lean)  # a recipe's call would run it, without wg's gradient
        elif "HAS_WG" in fn.arg_names:  # the split backward's carried part, as a recipe's call runs it
            consts.update(HAS_WG=False)
        ptr = {"fp32": "*fp32", "bf16": "*bf16", "fp16": "*fp16"}[half]
        sig = {n: "constexpr" if n in consts else "i32" if n in _INTS else ptr if n in _HALF else "*fp32"
               for n in fn.arg_names}
        ints = {"C": chunk, "D": head_dim, "H1": hidden}
        scan = True
    if num_ctas != 1:  # Triton's default otherwise, and the records keep their keys
        launch["num_ctas"] = num_ctas
    target = GPUTarget("cuda", arch, 32)
    attrs = _launch_specialization(fn, sig, consts, ints, target)
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    log = io.StringIO()
    saved = knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile
    knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = True, True  # a cached binary prints no log
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(src, target=target, options=launch)
    finally:
        knobs.nvidia.dump_ptxas_log, knobs.compilation.always_compile = saved
    loops, program = cubin_loops(compiled.asm["cubin"], launch["num_warps"], whole=True)
    return {"kernel": kernel, "depth": depth if scan else None, "any_depth": deep if scan else None,
            "head_dim": head_dim, "hidden": hidden, "chunk": chunk, "half": half, "capability": arch, **launch,
            **({"num_ctas": compiled.metadata.num_ctas} if num_ctas != 1 else {}),  # what was compiled
            "cubin_sha256": hashlib.sha256(compiled.asm["cubin"]).hexdigest(), "shared": compiled.metadata.shared,
            **_ptxas_figures(log.getvalue()),
            **cubin_frame(compiled.asm["cubin"], launch["num_warps"]), "loops": loops, "program": program}


__all__ = ["KERNELS", "cache_figures", "compile_kernel", "cubin_frame", "cubin_loops", "sass_loops", "sass_program",
           "stack_frame"]
