"""Routed memory attention (crossattn-memory-banks paper, Section 4): throughput and peak memory of the Triton
kernels (memtrain.kernels.routed_attention, ``impl="triton"``) against gather-then-SDPA and dense SDPA, on one
CUDA GPU in bf16, at the proposal's shapes scaled to one GPU: C = 1000 chapters of N_c = 1000 tokens, top-k in
{10, 20}, model width d in {1024, 2048, 4096} with head dim 128 (H = d / 128). The key/value storage holds
only the U <= C chapters actually routed (``[U, N_c, H, D]``, as the model passes them).

Measured, one JSON line per configuration (median of ``--repeats`` runs after ``--warmup`` runs,
``torch.cuda.Event`` timing; forward under ``torch.no_grad``, forward+backward with every input a leaf that
needs a gradient -- queries, keys, values and the log router weights -- and a fixed random output gradient;
peak memory = ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, inputs included, and
``*_extra_bytes`` = that peak minus what was allocated before the call):

1. ``"kind": "sequence"``: ``sequence_routed_attention`` with ``q`` ``[B, T, H, D]``, each sequence reading
   k distinct chapters drawn uniformly from C. Paths: ``kernel`` (``impl="triton"``), ``gather_sdpa`` (the
   PyTorch reference, ``impl="torch"``: gathers each sequence's k N_c keys and values, float32 accumulation
   as the reference does), ``gather_sdpa_bf16`` (the same gather-then-SDPA kept in bf16, log weights as a
   bf16 additive mask) and ``dense_sdpa`` (``F.scaled_dot_product_attention`` on contiguous bf16
   ``[B, H, T, D]`` queries against ``[B, H, k N_c, D]`` keys and values: the same number of keys per
   query, no bias, default backend selection). Ratios ``ratio_vs_dense_sdpa`` / ``ratio_vs_gather_sdpa`` /
   ``ratio_vs_gather_sdpa_bf16`` = kernel TFLOP/s over the other's (same FLOPs, so inverse time ratios).
2. ``"kind": "token"``: ``token_routed_attention`` with ``q`` ``[N, H, D]``, each token reading k distinct
   chapters, in two routing settings: ``"balanced"`` (the N k (token, slot) pairs spread exactly evenly over
   U = N k / ``--rows-per-chapter`` chapters, 256 query rows per chapter by default) and ``"uniform"`` (k
   distinct chapters per token drawn uniformly from C = 1000; N k / C rows per chapter on average). Paths:
   ``kernel``, ``grouped_reference`` (``impl="torch"``: a PyTorch loop over chapters, float32) and
   ``dense_sdpa``: the equal-FLOP dense SDPA with the same number of keys per query, bf16 ``[1, H, N, D]``
   queries against ``[1, H, k N_c, D]`` keys and values. In the balanced setting also
   ``dense_sdpa_per_chapter``: ``[U, H, N k / U, D]`` queries against ``[U, H, N_c, D]`` (the grouped
   problem the kernel solves, as one batched dense SDPA; same FLOPs). Memory against naive per-token
   gathering, computed analytically and never allocated: ``naive_gather_bytes`` = N k N_c H D 2 (keys and
   values) x 2 bytes (bf16); ``memory_ratio_vs_naive`` = that / the kernel's forward peak (inputs included,
   so conservative: the naive figure counts the gathered copy alone), ``memory_ratio_vs_naive_extra`` = that
   / the memory the kernel's forward adds beyond its inputs.
3. ``"kind": "summary"``: the three targets (one H100), each with its value, the configurations it covers
   and ``target_met`` (computed; false when a covered measurement is missing, e.g. out of memory):

   - sequence level at least 70% of dense SDPA's TFLOP/s over the same keys (min over configurations of
     ``ratio_vs_dense_sdpa``, forward and forward+backward);
   - token level at least 50% of dense SDPA's TFLOP/s where every routed chapter receives >= 256 query rows
     (min of the token ``ratio_vs_dense_sdpa`` over those configurations, both passes);
   - token-level peak memory at least 100x below naive gathering (min ``memory_ratio_vs_naive`` over the
     token configurations; the proposal's shapes are the full run's, not ``--quick``'s).

FLOP accounting (FlashAttention's): forward = 4 x queries x keys per query x H x D (two matmuls, QK^T and
PV; softmax and the slot merge not counted), i.e. 4 B T H D k N_c (sequence) and 4 N k N_c H D (token);
backward = 2.5 x forward (five matmuls, the recomputed QK^T included), so forward+backward = 3.5 x forward.
TFLOP/s = FLOPs / median seconds / 1e12. The kernels' routing bookkeeping (block tables, sorting pairs by
chapter, the per-token merge) is inside the timed call, as it is in the model.

    python benchmarks/routed_attention.py --quick        # small shapes, well under a minute on a GPU
    python benchmarks/routed_attention.py                # the scaled proposal shapes (several minutes)
    python benchmarks/routed_attention.py --out ra.jsonl # also write the JSON lines to a file
    python benchmarks/routed_attention.py --interpret    # tiny CPU correctness smoke (Triton interpreter)

Without a CUDA device it prints one ``{"skipped": ...}`` line and exits 0 (``--interpret`` excepted: kernel
against reference, outputs and gradients, at B=1, T=16, H=1, D=16, U=3, N_c=16, k=2 under
``TRITON_INTERPRET=1``; exits 1 on a mismatch). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The package imports triton_kernels (and so decorates the kernels) only on the first impl="triton" call,
# after main() has set TRITON_INTERPRET for --interpret.
from memtrain.kernels.routed_attention import (  # noqa: E402
    sequence_routed_attention, token_routed_attention, triton_available)

CHAPTERS = 1000  # C
CHAPTER_TOKENS = 1000  # N_c
HEAD_DIM = 128
BWD_FACTOR = 2.5
FLOPS_NOTE = ("forward = 4 x queries x keys_per_query x H x D (QK^T and PV matmuls); backward = 2.5 x forward "
              "(FlashAttention accounting); fwd_bwd = 3.5 x forward")
FULL = {"dims": (1024, 2048, 4096), "ks": (10, 20), "batch": 4, "seq_len": 2048, "tokens": 8192}
QUICK = {"dims": (1024,), "ks": (10, 20), "batch": 2, "seq_len": 512, "tokens": 2048}
TARGET_SEQUENCE = 0.7  # kernel / dense SDPA TFLOP/s
TARGET_TOKEN = 0.5  # kernel / dense SDPA TFLOP/s, chapters with >= MIN_ROWS query rows
MIN_ROWS = 256
TARGET_MEMORY = 100.0  # naive gather bytes / kernel peak


# --------------------------------------------------------------------------------------------------
# Timing and memory


def clear(leaves) -> None:
    for x in leaves:
        x.grad = None


def median_ms(run, leaves, warmup: int, repeats: int) -> float:
    """Median milliseconds of ``run()`` between two CUDA events (gradients cleared before every run)."""
    for _ in range(warmup):
        clear(leaves)
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        clear(leaves)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peak_bytes(run, leaves) -> tuple[int, int]:
    """(peak allocated bytes during one ``run()``, inputs included; that peak minus the bytes before it)."""
    clear(leaves)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    clear(leaves)
    return peak, peak - base


def measure(fn, leaves, grad_out, flops_fwd: float, warmup: int, repeats: int) -> dict:
    """Forward and forward+backward median time, TFLOP/s and peak memory of ``fn()``; whatever was measured
    before an error (out of memory, no SDPA backend...) stays, with ``error``."""
    res: dict = {}

    def fwd():
        with torch.no_grad():
            fn()

    def fwd_bwd():
        fn().backward(grad_out)

    try:
        ms = median_ms(fwd, leaves, warmup, repeats)
        res.update(fwd_ms=sig(ms), fwd_tflops=sig(flops_fwd / (ms * 1e-3) / 1e12))
        res["fwd_peak_bytes"], res["fwd_extra_bytes"] = peak_bytes(fwd, leaves)
        ms = median_ms(fwd_bwd, leaves, warmup, repeats)
        flops = (1 + BWD_FACTOR) * flops_fwd
        res.update(fwd_bwd_ms=sig(ms), fwd_bwd_tflops=sig(flops / (ms * 1e-3) / 1e12))
        res["fwd_bwd_peak_bytes"], res["fwd_bwd_extra_bytes"] = peak_bytes(fwd_bwd, leaves)
    except Exception as e:  # noqa: BLE001 - report, keep benchmarking the other paths
        res["error"] = f"{type(e).__name__}: {e}"[:300]
    finally:
        clear(leaves)
        torch.cuda.empty_cache()
    return res


def ratios(rec: dict, num: str, den: str, field: str) -> dict:
    """Per pass, ``num``'s over ``den``'s: TFLOP/s (``field="tflops"``; every path of a record does the same
    FLOPs, so the inverse ratio of the median times) or peak bytes (``"peak_bytes"``); None where missing."""
    out = {}
    for p in ("fwd", "fwd_bwd"):
        if field == "tflops":  # unrounded: den's time over num's
            a, b = rec.get(den, {}).get(f"{p}_ms"), rec.get(num, {}).get(f"{p}_ms")
        else:
            a, b = rec.get(num, {}).get(f"{p}_{field}"), rec.get(den, {}).get(f"{p}_{field}")
        out[p] = round(a / b, 4) if a is not None and b else None
    return out


def sig(x: float) -> float:
    return float(f"{x:.4g}")


def max_abs_diff(kernel, reference) -> dict:
    """Forward check: max |kernel - reference| and max |reference| (no_grad)."""
    try:
        with torch.no_grad():
            want = reference().float()
            got = kernel().float()
        return {"max_abs_diff": float((got - want).abs().max()), "max_abs_reference": float(want.abs().max())}
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    finally:
        torch.cuda.empty_cache()


def leaf(*shape, g, device, dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=g, device=device).to(dtype).requires_grad_()


def distinct_chapters(rows: int, k: int, n: int, g, device) -> torch.Tensor:
    """``[rows, k]``: k distinct chapters out of ``n`` per row, uniformly."""
    return torch.rand(rows, n, generator=g, device=device).argsort(dim=-1)[:, :k]


# --------------------------------------------------------------------------------------------------
# Sequence level


def gather_sdpa_bf16(q, keys, values, slots, log_w):
    """Gather-then-SDPA kept in the inputs' dtype: each sequence's k N_c keys and values copied out, the log
    weights as an additive mask (the reference's computation without its float32 promotion)."""
    B, T, H, D = q.shape
    k, Nc = slots.shape[1], keys.shape[1]
    k_seq = keys[slots].reshape(B, k * Nc, H, D).transpose(1, 2)
    v_seq = values[slots].reshape(B, k * Nc, H, D).transpose(1, 2)
    bias = log_w.to(q.dtype)[:, :, None].expand(B, k, Nc).reshape(B, 1, 1, k * Nc)
    return F.scaled_dot_product_attention(q.transpose(1, 2), k_seq, v_seq, attn_mask=bias).transpose(1, 2)


def bench_sequence(d: int, k: int, B: int, T: int, warmup: int, repeats: int, device, dtype) -> dict:
    H, D, Nc = d // HEAD_DIM, HEAD_DIM, CHAPTER_TOKENS
    g = torch.Generator(device=device).manual_seed(d + k)
    used, slots = torch.unique(distinct_chapters(B, k, CHAPTERS, g, device), return_inverse=True)
    U = used.numel()  # the storage holds only the routed chapters
    flops = 4.0 * B * T * H * D * (k * Nc)
    rec: dict = {"kind": "sequence",
                 "config": {"d": d, "heads": H, "head_dim": D, "batch": B, "seq_len": T, "top_k": k,
                            "chapters": CHAPTERS, "chapter_tokens": Nc, "stored_chapters": U,
                            "keys_per_query": k * Nc},
                 "flops_fwd": flops}
    q = leaf(B, T, H, D, g=g, device=device, dtype=dtype)
    keys = leaf(U, Nc, H, D, g=g, device=device, dtype=dtype)
    values = leaf(U, Nc, H, D, g=g, device=device, dtype=dtype)
    log_w = torch.randn(B, k, generator=g, device=device).log_softmax(-1).requires_grad_()
    leaves = [q, keys, values, log_w]
    grad_out = torch.randn(B, T, H, D, generator=g, device=device).to(dtype)

    def path(impl):
        return lambda: sequence_routed_attention(q, keys, values, slots, log_w, impl=impl)

    rec["check_kernel_vs_reference"] = max_abs_diff(path("triton"), path("torch"))
    rec["kernel"] = measure(path("triton"), leaves, grad_out, flops, warmup, repeats)
    rec["gather_sdpa"] = measure(path("torch"), leaves, grad_out, flops, warmup, repeats)
    rec["gather_sdpa_bf16"] = measure(lambda: gather_sdpa_bf16(q, keys, values, slots, log_w), leaves, grad_out,
                                      flops, warmup, repeats)
    del q, keys, values, log_w, leaves, grad_out
    torch.cuda.empty_cache()
    try:
        dq = leaf(B, H, T, D, g=g, device=device, dtype=dtype)
        dk = leaf(B, H, k * Nc, D, g=g, device=device, dtype=dtype)
        dv = leaf(B, H, k * Nc, D, g=g, device=device, dtype=dtype)
        dgrad = torch.randn(B, H, T, D, generator=g, device=device).to(dtype)
        rec["dense_sdpa"] = measure(lambda: F.scaled_dot_product_attention(dq, dk, dv), [dq, dk, dv], dgrad, flops,
                                    warmup, repeats)
        del dq, dk, dv, dgrad
    except Exception as e:  # noqa: BLE001 - e.g. out of memory allocating the inputs
        rec["dense_sdpa"] = {"error": f"{type(e).__name__}: {e}"[:300]}
    torch.cuda.empty_cache()
    rec["ratio_vs_dense_sdpa"] = ratios(rec, "kernel", "dense_sdpa", "tflops")
    rec["ratio_vs_gather_sdpa"] = ratios(rec, "kernel", "gather_sdpa", "tflops")
    rec["ratio_vs_gather_sdpa_bf16"] = ratios(rec, "kernel", "gather_sdpa_bf16", "tflops")
    rec["memory_ratio_gather_sdpa_over_kernel"] = ratios(rec, "gather_sdpa", "kernel", "peak_bytes")
    rec["memory_ratio_gather_sdpa_bf16_over_kernel"] = ratios(rec, "gather_sdpa_bf16", "kernel", "peak_bytes")
    rec["memory_ratio_dense_sdpa_over_kernel"] = ratios(rec, "dense_sdpa", "kernel", "peak_bytes")
    return rec


# --------------------------------------------------------------------------------------------------
# Token level


def token_slots(setting: str, N: int, k: int, rows_per_chapter: int, g, device) -> torch.Tensor:
    """``[N, k]`` distinct chapters per token. ``balanced``: pair (i, j) -> chapter (i k + j) mod U with
    U = N k / rows_per_chapter (k consecutive values, so distinct per token when U >= k), chapter ids and
    token order shuffled: every chapter gets exactly rows_per_chapter rows when U divides N k. ``uniform``: k
    distinct chapters out of C per token, uniformly."""
    if setting == "uniform":
        return distinct_chapters(N, k, CHAPTERS, g, device)
    U = max(k, min(CHAPTERS, (N * k) // rows_per_chapter))
    pairs = torch.arange(N * k, device=device).view(N, k) % U
    perm = torch.randperm(U, generator=g, device=device)
    return perm[pairs][torch.randperm(N, generator=g, device=device)]


def bench_token(setting: str, d: int, k: int, N: int, rows_per_chapter: int, warmup: int, repeats: int, device,
                dtype) -> dict:
    H, D, Nc = d // HEAD_DIM, HEAD_DIM, CHAPTER_TOKENS
    g = torch.Generator(device=device).manual_seed(d + k + N)
    used, slots = torch.unique(token_slots(setting, N, k, rows_per_chapter, g, device), return_inverse=True)
    U = used.numel()
    counts = torch.bincount(slots.reshape(-1), minlength=U)
    flops = 4.0 * N * k * Nc * H * D
    elem = torch.empty((), dtype=dtype).element_size()
    naive = N * k * Nc * H * D * 2 * elem
    rec: dict = {"kind": "token",
                 "config": {"setting": setting, "d": d, "heads": H, "head_dim": D, "tokens": N, "top_k": k,
                            "chapters": CHAPTERS, "chapter_tokens": Nc, "stored_chapters": U,
                            "keys_per_query": k * Nc},
                 "rows_per_chapter": {"min": int(counts.min()), "mean": round(N * k / U, 2),
                                      "max": int(counts.max())},
                 "flops_fwd": flops, "naive_gather_bytes": naive}
    q = leaf(N, H, D, g=g, device=device, dtype=dtype)
    keys = leaf(U, Nc, H, D, g=g, device=device, dtype=dtype)
    values = leaf(U, Nc, H, D, g=g, device=device, dtype=dtype)
    log_w = torch.randn(N, k, generator=g, device=device).log_softmax(-1).requires_grad_()
    leaves = [q, keys, values, log_w]
    grad_out = torch.randn(N, H, D, generator=g, device=device).to(dtype)

    def path(impl):
        return lambda: token_routed_attention(q, keys, values, slots, log_w, impl=impl)

    rec["check_kernel_vs_reference"] = max_abs_diff(path("triton"), path("torch"))
    rec["kernel"] = measure(path("triton"), leaves, grad_out, flops, warmup, repeats)
    rec["grouped_reference"] = measure(path("torch"), leaves, grad_out, flops, warmup, repeats)
    del q, keys, values, log_w, leaves, grad_out
    torch.cuda.empty_cache()
    dense = [("dense_sdpa", (1, H, N, D), (1, H, k * Nc, D))]
    if setting == "balanced" and int(counts.min()) == int(counts.max()):
        dense.append(("dense_sdpa_per_chapter", (U, H, int(counts[0]), D), (U, H, Nc, D)))
    for name, q_shape, kv_shape in dense:
        try:
            dq = leaf(*q_shape, g=g, device=device, dtype=dtype)
            dk = leaf(*kv_shape, g=g, device=device, dtype=dtype)
            dv = leaf(*kv_shape, g=g, device=device, dtype=dtype)
            dgrad = torch.randn(*q_shape, generator=g, device=device).to(dtype)
            rec[name] = measure(lambda: F.scaled_dot_product_attention(dq, dk, dv), [dq, dk, dv], dgrad, flops,
                                warmup, repeats)
            rec[name]["shapes"] = {"q": list(q_shape), "kv": list(kv_shape)}
            del dq, dk, dv, dgrad
        except Exception as e:  # noqa: BLE001
            rec[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
        torch.cuda.empty_cache()
    rec["ratio_vs_dense_sdpa"] = ratios(rec, "kernel", "dense_sdpa", "tflops")
    if "dense_sdpa_per_chapter" in rec:
        rec["ratio_vs_dense_sdpa_per_chapter"] = ratios(rec, "kernel", "dense_sdpa_per_chapter", "tflops")
    rec["ratio_vs_grouped_reference"] = ratios(rec, "kernel", "grouped_reference", "tflops")
    kernel = rec["kernel"]
    rec["memory_ratio_vs_naive"] = round(naive / kernel["fwd_peak_bytes"], 2) if "fwd_peak_bytes" in kernel else None
    rec["memory_ratio_vs_naive_extra"] = (round(naive / kernel["fwd_extra_bytes"], 2)
                                          if kernel.get("fwd_extra_bytes") else None)
    return rec


# --------------------------------------------------------------------------------------------------
# Summary


def target(records: list, value_of, threshold: float, measure_text: str) -> dict:
    """Min of ``value_of(rec)`` (a list of numbers, None for a missing one) over ``records``; met when every
    covered value is present and the min reaches ``threshold``."""
    values, missing, worst, worst_cfg = [], 0, None, None
    for rec in records:
        for v in value_of(rec):
            if v is None:
                missing += 1
                continue
            values.append(v)
            if worst is None or v < worst:
                worst, worst_cfg = v, rec["config"]
    return {"threshold": threshold, "measure": measure_text, "value": worst, "worst_config": worst_cfg,
            "configs": len(records), "values_missing": missing,
            "target_met": bool(values) and missing == 0 and worst >= threshold}


def summary(seq: list, tok: list, quick: bool) -> dict:
    both = ("fwd", "fwd_bwd")
    dense_tok = [r for r in tok if r["rows_per_chapter"]["min"] >= MIN_ROWS]
    return {
        "kind": "summary",
        "shapes": "quick (smaller than the proposal's)" if quick else "scaled proposal shapes",
        "sequence_vs_dense_sdpa": target(
            seq, lambda r: [r["ratio_vs_dense_sdpa"][p] for p in both], TARGET_SEQUENCE,
            "min over sequence configs and both passes of kernel TFLOP/s / dense SDPA TFLOP/s (same keys)"),
        "token_vs_dense_sdpa": target(
            dense_tok, lambda r: [r["ratio_vs_dense_sdpa"][p] for p in both], TARGET_TOKEN,
            f"min over token configs whose every routed chapter gets >= {MIN_ROWS} query rows, both passes, of "
            "kernel TFLOP/s / equal-FLOP dense SDPA TFLOP/s ([1, H, N, D] vs [1, H, k N_c, D])"),
        "token_memory_vs_naive": target(
            tok, lambda r: [r["memory_ratio_vs_naive"]], TARGET_MEMORY,
            "min over token configs of naive_gather_bytes (N k N_c H D 2 x 2 bytes) / kernel forward peak "
            "(inputs included)"),
        "token_memory_vs_naive_extra_min": min((r["memory_ratio_vs_naive_extra"] for r in tok
                                                if r["memory_ratio_vs_naive_extra"] is not None), default=None),
    }


# --------------------------------------------------------------------------------------------------
# --interpret: a tiny CPU correctness smoke under the Triton interpreter


def interpret_smoke() -> list:
    torch.manual_seed(0)
    B, T, H, D, U, Nc, k, N = 1, 16, 1, 16, 3, 16, 2, 8
    cases = {
        "sequence": (sequence_routed_attention, [(B, T, H, D), (U, Nc, H, D), (U, Nc, H, D)],
                     torch.tensor([[2, 0]]), B),
        "token": (token_routed_attention, [(N, H, D), (U, Nc, H, D), (U, Nc, H, D)],
                  torch.stack([torch.randperm(U)[:k] for _ in range(N)]), N),
    }
    records = []
    for mode, (fn, shapes, slots, rows) in cases.items():
        inputs = [torch.randn(*s, requires_grad=True) for s in shapes]
        inputs.append(torch.randn(rows, k).log_softmax(-1).requires_grad_())
        results = {}
        for impl in ("triton", "torch"):
            out = fn(*inputs[:3], slots, inputs[3], impl=impl)
            grads = torch.autograd.grad(out, inputs, torch.ones_like(out))
            results[impl] = (out.detach(), grads)
        diffs = {"out": float((results["triton"][0] - results["torch"][0]).abs().max())}
        for name, a, b in zip(("q", "keys", "values", "log_w"), results["triton"][1], results["torch"][1]):
            diffs[f"grad_{name}"] = float((a - b).abs().max())
        records.append({"kind": "interpret", "mode": mode, "shapes": {"q": list(shapes[0]), "keys": list(shapes[1]),
                                                                       "top_k": k},
                        "max_abs_diff": diffs, "ok": all(v < 1e-4 for v in diffs.values())})
    return records


# --------------------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small shapes (well under a minute on a GPU)")
    ap.add_argument("--interpret", action="store_true",
                    help="tiny CPU correctness smoke under TRITON_INTERPRET=1 (kernel vs reference)")
    ap.add_argument("--only", choices=("sequence", "token"), default=None, help="run one routing level")
    ap.add_argument("--dims", default=None, help="comma-separated model widths d (head dim 128)")
    ap.add_argument("--ks", default=None, help="comma-separated top-k values")
    ap.add_argument("--batch", type=int, default=None, help="sequences B (sequence level)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence T (sequence level)")
    ap.add_argument("--tokens", type=int, default=None, help="query tokens N (token level)")
    ap.add_argument("--rows-per-chapter", type=int, default=MIN_ROWS,
                    help="query rows per chapter in the balanced token-level setting")
    ap.add_argument("--warmup", type=int, default=2, help="untimed runs first (Triton compiles on the first)")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs (median); default 3 quick, 5 full")
    ap.add_argument("--out", default=None, help="also write the JSON lines to this file")
    args = ap.parse_args()

    out = open(args.out, "w") if args.out else None

    def emit(rec: dict) -> None:
        line = json.dumps(rec)
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    try:
        if args.interpret:
            os.environ["TRITON_INTERPRET"] = "1"  # before triton_kernels is imported (decoration time)
        elif not torch.cuda.is_available():
            emit({"skipped": "no CUDA device: torch.cuda.is_available() is False (--interpret runs a CPU smoke)"})
            return 0
        if not triton_available():
            emit({"skipped": "triton is not importable"})
            return 0
        import triton

        env = {"torch": torch.__version__, "triton": triton.__version__}
        if args.interpret:
            records = interpret_smoke()
            for rec in records:
                emit({**rec, "device": "cpu (TRITON_INTERPRET=1)", **env})
            return 0 if all(r["ok"] for r in records) else 1

        device, dtype = torch.device("cuda"), torch.bfloat16
        sizes = QUICK if args.quick else FULL
        dims = tuple(int(x) for x in args.dims.split(",")) if args.dims else sizes["dims"]
        ks = tuple(int(x) for x in args.ks.split(",")) if args.ks else sizes["ks"]
        B, T = args.batch or sizes["batch"], args.seq_len or sizes["seq_len"]
        N = args.tokens or sizes["tokens"]
        repeats = args.repeats or (3 if args.quick else 5)
        env.update(device=torch.cuda.get_device_name(device),
                   device_memory_bytes=torch.cuda.get_device_properties(device).total_memory, dtype="bfloat16",
                   quick=args.quick, warmup=args.warmup, repeats=repeats, flops=FLOPS_NOTE)
        t0 = time.perf_counter()
        seq, tok = [], []
        for d in dims:
            for k in ks:
                if args.only in (None, "sequence"):
                    seq.append(bench_sequence(d, k, B, T, args.warmup, repeats, device, dtype))
                    emit({**seq[-1], **env})
                if args.only in (None, "token"):
                    for setting in ("balanced", "uniform"):
                        tok.append(bench_token(setting, d, k, N, args.rows_per_chapter, args.warmup, repeats,
                                               device, dtype))
                        emit({**tok[-1], **env})
        emit({**summary(seq, tok, args.quick), "total_s": round(time.perf_counter() - t0, 1), **env})
        return 0
    finally:
        if out:
            out.close()


if __name__ == "__main__":
    sys.exit(main())
