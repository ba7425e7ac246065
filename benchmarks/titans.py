"""Titans neural memory: forward+backward throughput of the fused Triton kernels, the PyTorch chunked inner
loop and the per-token sequential reference (and titans-pytorch's ``NeuralMemory`` when importable).

Prints one JSON line per configuration: the settings, forward+backward tokens/s of
``NeuralMemory(..., algorithm="chunked")`` with ``kernel="torch"`` and ``algorithm="sequential"`` (same
module, same width, heads, depth and chunk size, so the same math), ``speedup_chunked_vs_sequential``;
on CUDA the kernel columns (``kernel="triton"`` under bf16 autocast, as bf16 training runs it:
``kernel_bf16_tokens_per_s``, its speedups over the PyTorch chunked form and over titans-pytorch,
``kernel_first_call_s`` (compilation) and ``kernel_max_rel_err_vs_torch``, the largest relative error of
output and input gradient against the PyTorch form on the first 1024 tokens, with ``kernel_nonfinite`` and
``torch_nonfinite`` counting their non-finite elements; ``kernel_impl`` names the kernel
pair: ``triton_kernels`` for depth 1-2, ``triton_deep`` for depth 3+; at depth 1-2 the ``kernel_any_depth_*``
columns time ``triton_deep`` as well, to show what holding the state in registers buys, unless
``--no-any-depth``, and ``kernel_forward`` / ``kernel_backward`` / ``kernel_stages`` name the scan kernels' forms
those columns ran while each other form of ``--forms`` (default ``shipped,split``: the split form splits forward and
backward; ``pipelined`` also pipelines its loops) gets its own ``kernel_<form>_*`` columns; ``--profile K`` adds one
profiled forward+backward of the kernels, ``kernel_profile_*``: device-busy fraction and the top K ops); and
``titans_pytorch`` (tokens/s of titans-pytorch's layer at the closest settings, or
``"not installed"``). The layer is built with the Titans recipes' memory settings (:func:`make_memory`), not
``NeuralMemory``'s paper defaults, which diverge at these sizes. Each timing is the median over repeats after a
short warm-up; the loss is the mean square of the layer output. Not part of the test suite.

    python benchmarks/titans.py --quick        # CPU, T = 2048, a few minutes
    python benchmarks/titans.py                # larger sizes (GPU)
    python benchmarks/titans.py --quick --titans-pytorch-path DIR   # DIR: a pip --target holding it

titans-pytorch (PyPI ``titans-pytorch``, checked at 0.5.5) is optional and never a dependency of
memtrain: ``pip install --dry-run titans-pytorch`` keeps torch but pulls ~12 packages (tensordict,
x-transformers, einx, assoc-scan, ...), so it is best installed into a separate folder
(``pip install --target DIR --no-deps titans-pytorch <its deps>``) and passed with
``--titans-pytorch-path``. Its ``NeuralMemory`` is benchmarked with ``chunk_size = batch_size = C``
(``batch_size`` makes every chunk take its gradients at the weights after the previous chunk, as in
the paper; with the default ``batch_size=None`` every chunk of a call takes them at the call's
initial weights -- reported separately as ``titans_pytorch_no_ttt_batch``) and a depth/expansion-
matched ``MemoryMLP``. How its semantics differ from the paper (and from memtrain's layer):

- retrieval timing: it reads per *chunk*, not per token: queries are shifted by one and token t
  reads the weights after the last chunk completed at or before t (the initial weights before the
  first chunk completes), so only a chunk's last token sees that chunk's update; the others see
  neither their own nor their chunk-mates' updates. memtrain (paper eq. 15) reads
  ``y_t = M_t(q_t)`` with the weights after token t's own update;
- momentum and forgetting are per chunk: eta and alpha come from the chunk's *mean-pooled* input
  (``AveragePool``) and the momentum / decay scans run over chunks (summed, lr-weighted chunk
  gradients), not over tokens; only the learning rate is per token. memtrain keeps the per-token
  recurrence of eqs. 13-14 inside the chunk (or, with ``gate_mode="chunk"``, takes a chunk's gates
  from its first token -- a causal choice, unlike a mean);
- partial chunks: trailing tokens that do not fill a chunk are cached and only stored once the chunk
  is complete; memtrain updates at every token and carries the mid-chunk state exactly;
- loss and gates: the inner loss is the mean over features (the paper's / memtrain's is the sum, a
  factor d on the gradient), the default learning rate is ``sigmoid(.) * 1.0``;
- memory model: ``MemoryMLP`` with GELU (paper: SiLU) and default expansion 4, wrapped in a
  LayerNorm + residual (``x + LN(MLP(x))``, from TTT); memtrain's memory is the bare MLP;
- projections: pre-RMSNorm on the input, no depthwise convolutions, no SiLU on q/k/v and no
  L2-normalised q/k by default (Section 4.4 asks for all three); output is a per-head scalar sigmoid
  gate and a linear head merge without an output norm.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmarks' profiling helper

from memtrain.config import TitansConfig  # noqa: E402
from memtrain.kernels import titans as titans_kernels  # noqa: E402
from memtrain.kernels.titans import triton_available  # noqa: E402
from memtrain.model.titans import NeuralMemory  # noqa: E402
from profiling import profile_call  # noqa: E402

FULL = [  # (batch, seq_len, dim, heads, depth, chunk_size)
    (4, 2048, 512, 8, 2, 64),
    (4, 8192, 512, 8, 2, 64),
    (2, 2048, 768, 12, 2, 16),
    (4, 2048, 512, 8, 3, 64),  # deeper memories (Section 5.5 varies L_M from 1 to 4): the any-depth kernels
    (4, 2048, 512, 8, 4, 64),
]
QUICK = [
    (1, 2048, 256, 4, 2, 64),
    (1, 2048, 256, 4, 2, 16),
]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_fwd_bwd(step, x: torch.Tensor, repeats: int, warmup_x: torch.Tensor) -> float:
    """Median seconds of one forward+backward of ``step(x)`` (a scalar loss)."""
    device = x.device
    step(warmup_x).backward()  # warm-up on a short sequence (allocator, kernels)
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step(x).backward()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def titans_pytorch_class(path: str | None):
    if path:
        sys.path.insert(0, path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from titans_pytorch import NeuralMemory as TPNeuralMemory
        return TPNeuralMemory, None
    except Exception as e:  # ImportError, or a broken install
        return None, f"{type(e).__name__}: {e}"


def make_memory(dim: int, heads: int, depth: int, chunk: int) -> NeuralMemory:
    """The layer as the Titans recipes build it (``model.titans``'s defaults: inner learning rate at most 0.003,
    starting at 0.001, momentum at most 0.95, values normalised). ``NeuralMemory``'s own defaults are the paper's
    form (0.1 / 0.01, unbounded momentum, raw values), whose inner loop diverges here: at chunk 64 its weights
    reach NaN within the first 2,048 tokens of these random inputs (first GPU run, 2026-11-27: the error column
    came out NaN)."""
    t = TitansConfig()
    return NeuralMemory(dim, heads=heads, depth=depth, chunk_size=chunk, expansion=t.expansion,
                        conv_kernel=t.conv_kernel, gate_mode=t.gate_mode, max_lr=t.memory_max_lr,
                        init_lr=t.memory_init_lr, max_momentum=t.memory_max_momentum, value_norm=t.memory_value_norm)


def run(cfg, device: torch.device, repeats: int, seq_repeats: int, tp_cls, tp_error: str | None,
        any_depth: bool = True, forms: tuple[str, ...] = ("shipped",), profile: int = 0) -> dict:
    B, T, dim, H, depth, C = cfg
    torch.manual_seed(0)
    mem = make_memory(dim, H, depth, C).to(device)
    x = torch.randn(B, T, dim, device=device)
    warm = x[:, : 2 * C + 3]
    out = {"device": str(device), "threads": torch.get_num_threads(), "batch": B, "seq_len": T, "dim": dim,
           "heads": H, "head_dim": dim // H, "depth": depth, "expansion": 2.0, "chunk_size": C,
           "gate_mode": mem.gate_mode, "conv_kernel": mem.conv_kernel}
    secs = {}
    mem.kernel = "torch"
    for algorithm, reps in (("chunked", repeats), ("sequential", seq_repeats)):
        secs[algorithm] = time_fwd_bwd(lambda inp: mem(inp, algorithm=algorithm)[0].square().mean(), x, reps, warm)
        out[f"{algorithm}_tokens_per_s"] = round(B * T / secs[algorithm], 1)
        out[f"{algorithm}_s"] = round(secs[algorithm], 4)
    out["speedup_chunked_vs_sequential"] = round(secs["sequential"] / secs["chunked"], 2)
    if device.type == "cuda" and triton_available():
        out.update(kernel_columns(mem, x, warm, repeats, secs, any_depth, forms, profile))
    else:
        out["kernel"] = "skipped: the Triton kernels are timed on CUDA only"
    if tp_cls is None:
        out["titans_pytorch"] = "not installed"
        out["titans_pytorch_error"] = tp_error
        return out
    for key, batch_size in (("titans_pytorch", C), ("titans_pytorch_no_ttt_batch", None)):
        try:
            torch.manual_seed(0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tp = tp_cls(dim, chunk_size=C, batch_size=batch_size, dim_head=dim // H, heads=H,
                            default_model_kwargs=dict(depth=depth, expansion_factor=2.0)).to(device)
                s = time_fwd_bwd(lambda inp: tp(inp)[0].square().mean(), x, repeats, x[:, : 2 * C])
            out[f"{key}_tokens_per_s"] = round(B * T / s, 1)
            out[f"chunked_vs_{key}"] = round(s / secs["chunked"], 2)
            if "kernel_bf16" in secs:
                out[f"kernel_bf16_vs_{key}"] = round(s / secs["kernel_bf16"], 2)
        except Exception as e:  # an incompatible version: report, do not fail the benchmark
            out[key] = f"failed: {type(e).__name__}: {e}"
    return out


def kernel_columns(mem: NeuralMemory, x: torch.Tensor, warm: torch.Tensor, repeats: int, secs: dict,
                   any_depth: bool = True, forms: tuple[str, ...] = ("shipped",), profile: int = 0,
                   weights_dtype: torch.dtype = torch.bfloat16) -> dict:
    """The fused Triton kernels (``kernel="triton"``) as bf16 training runs them (bf16 autocast: bf16 q/k/v and
    dot products, fp32 gates, state and accumulation): forward+backward tokens/s, the first call's wall time
    (Triton compiles the two kernels), and the largest relative error of the output and the input gradient
    against the PyTorch chunked form under the same autocast (which runs the inner loop in fp32), i.e. the
    bf16 rounding of the kernels' dot products. float32 inputs are not timed: ``auto`` keeps them in PyTorch
    (module docstring of memtrain.kernels.titans). At depth 1-2 ``kernel_forward``, ``kernel_backward`` and
    ``kernel_stages`` name the forms those columns ran (the defaults, or ``MEMTRAIN_TITANS_FORWARD`` / ``_BACKWARD`` /
    ``_STAGES``), and each other form of ``forms`` (``shipped``, ``lean``, ``split``, ``pipelined``:
    :data:`memtrain.kernels.titans.FORMS`) gets the same columns, ``kernel_<form>_*``, through those variables.
    ``profile`` > 0: one more forward+backward of the default kernels profiled (``kernel_profile_*``: wall time,
    device-busy fraction, the top ``profile`` ops: :func:`profiling.profile_call`). ``kernel_<bf16>_weights_*``: the
    layer as memtrain's own bf16 training runs it (DeepSpeed bf16, no autocast): its weights and input in
    ``weights_dtype``, so the fused output stage runs too (under autocast the input, and so the output stage's dtype,
    stays float32 while the gate is bf16, and the stage runs in PyTorch); its error is against the float32 layer's
    PyTorch form without autocast."""
    B, T = x.shape[:2]
    out = {}

    check = x[:, : min(T, 1024)]

    def fwd_bwd(m: NeuralMemory, inp: torch.Tensor, autocast: bool = True):
        """``m``'s output and input gradient on ``inp`` (the loss: the output's mean square), under bf16 autocast."""
        inp = inp.detach().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            y = m(inp)[0].float()
        (g,) = torch.autograd.grad(y.square().mean(), inp)
        return y.detach(), g.float()

    def nonfinite(tensors) -> int:  # which side a NaN error comes from: non-finite elements of output and gradient
        return int(sum((~torch.isfinite(t)).sum().item() for t in tensors))

    def first_call(prefix: str, run, ref) -> None:
        """``run()``'s first call timed (compilation), its output and input gradient against ``ref``'s."""
        _sync(x.device)
        t0 = time.perf_counter()
        got = run()
        _sync(x.device)
        out[f"{prefix}_first_call_s"] = round(time.perf_counter() - t0, 2)
        out[f"{prefix}_max_rel_err_vs_torch"] = max(
            ((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, ref))
        out[f"{prefix}_nonfinite"] = nonfinite(got)

    def columns(prefix: str) -> None:
        mem.kernel = "torch"
        ref = fwd_bwd(mem, check)
        mem.kernel = "triton"
        first_call(prefix, lambda: fwd_bwd(mem, check), ref)
        if prefix == "kernel":
            out["torch_nonfinite"] = nonfinite(ref)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            secs[f"{prefix}_bf16"] = time_fwd_bwd(lambda inp: mem(inp)[0].float().square().mean(), x, repeats, warm)
        mem.kernel = "torch"
        out[f"{prefix}_bf16_tokens_per_s"] = round(B * T / secs[f"{prefix}_bf16"], 1)
        out[f"speedup_{prefix}_bf16_vs_chunked"] = round(secs["chunked"] / secs[f"{prefix}_bf16"], 2)

    def half_weights() -> None:
        prefix = f"kernel_{ {torch.bfloat16: 'bf16', torch.float16: 'fp16'}[weights_dtype]}_weights"
        half = copy.deepcopy(mem).to(weights_dtype)
        half.kernel = "triton"
        mem.kernel = "torch"
        ref = fwd_bwd(mem, check, autocast=False)
        first_call(prefix, lambda: fwd_bwd(half, check.to(weights_dtype), autocast=False), ref)
        secs[prefix] = time_fwd_bwd(lambda inp: half(inp)[0].float().square().mean(), x.to(weights_dtype), repeats,
                                    warm.to(weights_dtype))
        out[f"{prefix}_tokens_per_s"] = round(B * T / secs[prefix], 1)

    deep_from = titans_kernels.DEEP_KERNEL_MIN_DEPTH
    out["kernel_impl"] = "triton_deep" if mem.depth >= deep_from else "triton_kernels"
    columns("kernel")
    half_weights()
    if profile:
        mem.kernel = "triton"
        with torch.autocast("cuda", dtype=torch.bfloat16):
            prof = profile_call(lambda: mem(x)[0].float().square().mean().backward(), x.device, profile)
        mem.kernel = "torch"
        out.update({f"kernel_profile_{k}": v for k, v in prof.items()})
    if mem.depth < deep_from:
        from memtrain.kernels.titans.triton_kernels import backward_form, forward_form

        ran = {titans_kernels.FORWARD_ENV: forward_form(mem.chunk_size),
               titans_kernels.BACKWARD_ENV: backward_form(),
               titans_kernels.STAGES_ENV: str(titans_kernels.requested_stages())}
        out["kernel_forward"], out["kernel_backward"], out["kernel_stages"] = (  # what the "kernel" columns ran
            ran[titans_kernels.FORWARD_ENV], ran[titans_kernels.BACKWARD_ENV], int(ran[titans_kernels.STAGES_ENV]))
        for form in forms:
            if titans_kernels.form_env(form) == ran:
                continue
            with titans_kernels.kernel_form(form):  # read at every call of the scan
                columns(f"kernel_{form}")
    hidden = mem.init_weights[0].shape[-2]
    if any_depth and mem.depth < deep_from and titans_kernels.kernel_fits(mem.head_dim, hidden, deep_from):
        titans_kernels.DEEP_KERNEL_MIN_DEPTH = 1  # the any-depth kernels at this depth too
        try:
            columns("kernel_any_depth")
        finally:
            titans_kernels.DEEP_KERNEL_MIN_DEPTH = deep_from
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small CPU sizes (T = 2048)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats of the chunked path")
    ap.add_argument("--seq-repeats", type=int, default=1, help="timed repeats of the sequential reference")
    ap.add_argument("--configs", default=None,
                    help="comma-separated indices into the configuration list (FULL, or QUICK with --quick)")
    ap.add_argument("--titans-pytorch-path", default=None,
                    help="folder to prepend to sys.path for titans_pytorch (e.g. a pip --target folder)")
    ap.add_argument("--no-any-depth", dest="any_depth", action="store_false",
                    help="at depth 1-2, skip the any-depth kernels' columns (two more kernels to compile)")
    ap.add_argument("--forms", default="shipped,split",
                    help="at depth 1-2, the scan kernels' forms to time (comma-separated: shipped, lean -- the "
                         "backward's --, split -- forward and backward --, pipelined -- split, its loops in 2 "
                         "stages; MEMTRAIN_TITANS_FORWARD / _BACKWARD / _STAGES); default shipped,split")
    ap.add_argument("--profile", type=int, default=0, metavar="K",
                    help="on CUDA, profile one more forward+backward of the kernels: device-busy fraction, top K ops")
    args = ap.parse_args()
    forms = tuple(f.strip() for f in args.forms.split(",") if f.strip())
    unknown = [f for f in forms if f not in titans_kernels.FORMS]
    if unknown or not forms:
        ap.error(f"--forms takes {', '.join(titans_kernels.FORMS)} separated by commas, got {args.forms!r}")
    if args.profile < 0:
        ap.error("--profile must be >= 0")
    device = torch.device(args.device)
    repeats = args.repeats or (3 if args.quick else 5)
    tp_cls, tp_error = titans_pytorch_class(args.titans_pytorch_path)
    configs = QUICK if args.quick else FULL
    if args.configs:
        try:
            configs = [configs[int(i)] for i in args.configs.split(",")]
        except (ValueError, IndexError):
            ap.error(f"--configs takes indices 0-{len(configs) - 1} separated by commas, got {args.configs!r}")
    for cfg in configs:
        print(json.dumps(run(cfg, device, repeats, args.seq_repeats, tp_cls, tp_error, args.any_depth, forms,
                             args.profile)), flush=True)


if __name__ == "__main__":
    main()
