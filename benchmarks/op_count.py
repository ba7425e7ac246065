"""Device operations per training micro-batch of a recipe's model: how launch-bound eager execution is.

What. Builds the model of ``RECIPE [key=value ...]`` (``memtrain.model.build``, ``model.type`` decoder or
titans, with the recipe's fused loss), runs one forward and backward on one synthetic sequence of
``data.seq_len`` tokens in ``--dtype`` (bf16 by default, as GPU training runs) and counts, with a
``TorchDispatchMode``, every ATen op that runs a kernel on a GPU: views, ``detach``, ``empty`` /
``_unsafe_view`` (allocations and metadata) and ``promote_types`` (host-side) are left out. Triton launches of
the Titans kernels and of RoPE's (``memtrain.kernels.rope``, which ``apply_rope`` runs on a GPU) are counted too
(and the custom operators around them not again), and ``F.rms_norm`` as CUDA runs it (one fused kernel each way
where input and gain share a dtype; :class:`_FusedRMSNorm`), not as CPU's formula. Prints one JSON line:
``ops_forward``, ``ops_backward``, ``ops_total``, ``triton_launches``, the forward's ops per module class
(``forward_by_module``, with the memory layer's pieces and the kernels' coefficient set-up named), the most
frequent ops, and ``ops_per_token`` at the recipe's micro-batch (the count does not depend on the batch size).

Why. Each eager op costs the host a few microseconds of dispatch and launch whatever its size; a model
whose step issues more ops than the GPU can absorb in that time is launch-bound, not FLOP-bound. The count
depends on the model's structure (layers, MAC segments, memory chunks per call), not on its widths, so
``model.d_model=128 ...`` overrides give the paper recipes' counts on a CPU in seconds. No GPU figure is
derived here: multiply by a host's measured per-op cost to bound its tokens/s.

How the Titans kernels are handled. With ``model.titans.kernel: triton`` the kernel launches are stubbed
(counted, not run; their outputs are left unwritten, so values are meaningless) and the PyTorch code around
them (coefficients, padding, casts) runs and is counted as it would on a GPU. With ``torch`` the PyTorch
chunked form runs and its per-chunk loop is counted.

    python benchmarks/op_count.py recipes/titans-170m-mac.yaml model.d_model=128 model.n_heads=2 \\
        model.titans.memory_heads=2 model.ffn_dim=256 model.vocab_size=1024 data.tokenizer.vocab_size=1024 \\
        model.titans.kernel=triton

``--time K`` also times the host: K more forwards and backwards of the same micro-batch (after one untimed), without
the counter, the launches still stubbed, and prints ``host_ms_per_micro_batch`` (their median), ``host_forward_ms``
and ``host_backward_ms`` (each part's median) and ``host_us_per_op`` (the whole's over ``ops_total``): the Python,
dispatcher, autograd and allocator time one micro-batch costs the host before any kernel runs -- the floor under an
eager step's time where the device is faster than the host. The ops still compute on the CPU, so time it at a shape
whose tensors are tiny and whose structure is the recipe's (the count shows it is: same ``ops_total``); even tiny,
bf16 products and norms cost a CPU more than a GPU's launch of them (on the 2-core CPU used for development, about a
fifth of the twin's forward under cProfile was ``linear`` and ``rms_norm``, 48 and 62 us a call), so the figure is
an upper bound for those ops. For ``titans-170m-mac``, ``data.seq_len=128 model.titans.segment_len=16`` keep its 8
segments of one chunk each. CPU-side costs that only a GPU run has (CUDA's launch calls, Triton's launcher) are not
in it. ``MEMTRAIN_KERNEL_OPS=dispatch`` times the kernels' custom operators through torch's dispatcher
(``memtrain.kernels.op``).

    python benchmarks/op_count.py recipes/titans-170m-mac.yaml model.d_model=32 model.n_heads=2 \\
        model.titans.memory_heads=2 model.titans.memory_head_dim=16 model.ffn_dim=64 model.vocab_size=256 \\
        data.tokenizer.vocab_size=256 data.seq_len=128 model.titans.segment_len=16 model.titans.kernel=triton \\
        --time 7

Not part of the test suite (a smoke test runs it at a tiny size).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # kernel: triton passes its checks on a CPU; launches are stubbed

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

HOST_ONLY = {"detach", "empty", "_unsafe_view", "promote_types"}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class _StubLaunch:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](...)`` counts a launch and runs nothing."""

    def __init__(self, name: str, launches: collections.Counter):
        self.name, self.launches = name, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches[self.name] += 1
        return launch


class _Counter(TorchDispatchMode):
    def __init__(self, where: list[str]):
        super().__init__()
        self.where, self.ops, self.by_module = where, collections.Counter(), collections.Counter()
        self.paused = 0  # > 0: ops run uncounted (the CPU formula of an op a GPU runs as one kernel)

    def count(self, name: str) -> None:
        self.ops[name] += 1
        self.by_module[self.where[-1]] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        # memtrain's custom operators (the Titans kernels' wrappers) launch nothing themselves: their Triton
        # launches are counted instead
        if not self.paused and not func.is_view and name not in HOST_ONLY and func.namespace != "memtrain":
            self.count(name)
        return func(*args, **(kwargs or {}))


class _FusedRMSNorm(torch.autograd.Function):
    """``F.rms_norm`` counted as CUDA runs it: one ``_fused_rms_norm`` forward and one ``_fused_rms_norm_backward``.
    torch (2.11 and later) dispatches ``rms_norm`` on CUDA to that fused kernel pair where input and gain share a
    dtype (or there is no gain); on CPU it is its formula (about 7 ops forward and 15 backward), which runs here
    uncounted (same values and gradients)."""

    @staticmethod
    def forward(ctx, counter, rms_norm, x, weight, shape, eps):
        with torch.enable_grad():
            counter.paused += 1
            try:
                inner = [x.detach().requires_grad_(x.requires_grad)]
                if weight is not None:
                    inner.append(weight.detach().requires_grad_(weight.requires_grad))
                y = rms_norm(inner[0], shape, inner[1] if weight is not None else None, eps)
            finally:
                counter.paused -= 1
        counter.count("_fused_rms_norm")
        ctx.counter, ctx.inner, ctx.y = counter, inner, y
        return y.detach()

    @staticmethod
    def backward(ctx, gy):
        ctx.counter.count("_fused_rms_norm_backward")
        wanted = [t for t in ctx.inner if t.requires_grad]
        ctx.counter.paused += 1
        try:
            got = iter(torch.autograd.grad(ctx.y, wanted, gy) if wanted else ())
        finally:
            ctx.counter.paused -= 1
        grads = [next(got) if t.requires_grad else None for t in ctx.inner]
        return None, None, grads[0], grads[1] if len(grads) > 1 else None, None, None


@contextlib.contextmanager
def rms_norm_fused(counter: _Counter):
    """Within it, ``F.rms_norm`` is :class:`_FusedRMSNorm` where CUDA fuses it (matching dtypes, or no gain)."""
    import torch.nn.functional as F

    rms_norm = F.rms_norm

    def fused(x, normalized_shape, weight=None, eps=None):
        if weight is not None and weight.dtype != x.dtype:  # CUDA's composite fallback: its formula, counted
            return rms_norm(x, normalized_shape, weight, eps)
        # CUDA's kernel takes a contiguous input: a strided one is copied first (counted)
        return _FusedRMSNorm.apply(counter, rms_norm, x.contiguous(), weight, tuple(normalized_shape), eps)

    F.rms_norm = fused
    try:
        yield
    finally:
        F.rms_norm = rms_norm


def _label_calls(owner, attr: str, label: str, where: list[str]) -> None:
    fn = getattr(owner, attr)

    def labelled(*args, **kwargs):
        where.append(label)
        try:
            return fn(*args, **kwargs)
        finally:
            where.pop()
    setattr(owner, attr, labelled)


def count(recipe, dtype: torch.dtype, time_reps: int = 0) -> dict:
    from memtrain.kernels import rope
    from memtrain.kernels.titans import output, prologue, read, triton_deep, triton_kernels
    from memtrain.model import anchor, build
    from memtrain.model.titans import attention, memory

    launches: collections.Counter = collections.Counter()
    for mod, names in ((triton_kernels, ("_fwd_kernel", "_bwd_kernel", "_coef_fwd_kernel", "_coef_bwd_kernel",
                                         "_fwd_advance_kernel", "_fwd_read_kernel", "_bwd_recompute_kernel",
                                         "_bwd_local_kernel", "_bwd_carry_kernel")),
                       (triton_deep, ("_fwd_deep_kernel", "_bwd_deep_kernel")),
                       (prologue, ("_qkv_fwd_kernel", "_qkv_bwd_kernel", "_conv_grad_kernel", "_gates_fwd_kernel",
                                   "_gates_bwd_kernel")),
                       (output, ("_out_fwd_kernel", "_out_bwd_kernel")), (read, ("_read_fwd_kernel", "_read_bwd_kernel")),
                       (rope, ("_rope_kernel",))):
        for name in names:
            setattr(mod, name, _StubLaunch(name, launches))
    anchor.FUSED_ROPE_DEVICES = ("cpu", "cuda")  # apply_rope as on a GPU: the fused kernel (stubbed)
    where = ["model"]
    for attr in ("segment_queries", "read", "write", "_gates", "gated_output", "_queries", "_qkv_heads", "_conv"):
        _label_calls(memory.NeuralMemory, attr, f"NeuralMemory.{attr}", where)
    for attr in ("queries", "keys_values", "attend_heads"):  # MAC calls them directly (not through forward)
        _label_calls(attention.PrefixAttention, attr, f"PrefixAttention.{attr}", where)
    _label_calls(triton_kernels, "triton_chunk_coefficients", "chunk_coefficients", where)
    _label_calls(triton_kernels, "chunk_scan", "chunk_scan", where)

    torch.manual_seed(0)
    model = build(recipe.model).to(dtype)
    if recipe.train.loss_chunk_tokens and hasattr(model, "set_fused_loss"):
        model.set_fused_loss(recipe.train.loss_chunk_tokens)
    for module in model.modules():
        module.register_forward_pre_hook(lambda m, a, label=type(module).__name__: where.append(label))
        module.register_forward_hook(lambda m, a, out: (where.pop(), None)[1])  # None: output kept
    T = recipe.data.seq_len
    x = torch.randint(0, recipe.model.vocab_size, (1, T))
    counter = _Counter(where)
    with rms_norm_fused(counter), counter:
        out = model(x, labels=x.roll(-1, 1))
        forward, forward_launches = sum(counter.ops.values()), sum(launches.values())
        by_module = dict(counter.by_module.most_common())
        out.loss_sum.float().backward()
    total = sum(counter.ops.values())
    micro = recipe.train.micro_batch_size
    result = {"model_type": recipe.model.type, "seq_len": T, "micro_batch_size": micro, "dtype": str(dtype),
              "ops_forward": forward + forward_launches, "ops_backward": total - forward + sum(launches.values())
              - forward_launches, "ops_total": total + sum(launches.values()), "triton_launches": dict(launches),
              "ops_per_token": round((total + sum(launches.values())) / (micro * T), 3),
              "forward_by_module": by_module, "top_ops": counter.ops.most_common(12)}
    if time_reps:  # after the counts: the timed steps' launches are stubbed too, and counted in ``launches``
        result.update(_host_time(model, x, time_reps))
        result["host_us_per_op"] = round(result["host_ms_per_micro_batch"] * 1e3 / result["ops_total"], 2)
    return result


def _host_time(model, x: torch.Tensor, reps: int) -> dict:
    """The median wall time of ``reps`` forwards and backwards of ``x`` (after one untimed), nothing counted; and of
    the forward and the backward apart (``host_forward_ms``, ``host_backward_ms``: each part's median, so they need not
    add up to the whole's). Apart because they bound a GPU step differently: an eager forward is Python issuing ops one
    by one, on the step's critical path wherever the device finishes them sooner; the backward is mostly autograd's C++
    engine."""
    labels = x.roll(-1, 1)

    def step() -> tuple[float, float]:
        start = time.perf_counter()
        out = model(x, labels=labels)
        mid = time.perf_counter()
        out.loss_sum.float().backward()
        return mid - start, time.perf_counter() - mid

    step()
    forward, backward = zip(*(step() for _ in range(reps)))
    times = [f + b for f, b in zip(forward, backward)]
    ms = lambda t: round(t * 1e3, 2)  # noqa: E731
    return {"host_ms_per_micro_batch": ms(statistics.median(times)), "host_ms_all": [ms(t) for t in times],
            "host_forward_ms": ms(statistics.median(forward)), "host_backward_ms": ms(statistics.median(backward)),
            "host_torch_threads": torch.get_num_threads()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe", help="recipe YAML")
    ap.add_argument("overrides", nargs="*", help="key=value overrides, as for `memtrain train`")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="model dtype (default bf16)")
    ap.add_argument("--time", type=int, default=0, metavar="K",
                    help="also time K forwards and backwards on the host, nothing counted (see the module docstring)")
    args = ap.parse_args()
    if args.time < 0:
        ap.error(f"--time takes a count of repetitions (0: none), got {args.time}")
    from memtrain.config import load_recipe
    from memtrain.errors import MemtrainError
    from memtrain.kernels.op import requested_mode

    try:
        recipe = load_recipe(args.recipe, args.overrides)
        requested_mode()  # MEMTRAIN_KERNEL_OPS: --time times the path it names
    except (MemtrainError, ValueError) as e:
        print(f"op_count: {e}", file=sys.stderr)
        return 2
    if recipe.model.type not in ("decoder", "titans"):
        print(f"op_count: model.type {recipe.model.type!r} is not counted (decoder and titans are)", file=sys.stderr)
        return 2
    result = count(recipe, DTYPES[args.dtype], args.time)
    print(json.dumps({"recipe": args.recipe, "overrides": args.overrides, **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
