"""Document-masked attention: forward+backward time of the sdpa dense-mask path vs flex attention.

On CPU, where flex attention has no backward, all paths are timed forward-only (``"timed"`` says which).

Prints one JSON line per configuration (packed batch of random document lengths) with the device,
the median time of each path (mask construction included, as it happens once per forward), and
``ratio_sdpa_over_flex`` (> 1: flex is faster). Plain causal sdpa (``is_causal``, no document mask)
is timed too as a lower bound. Not part of the test suite.

    python benchmarks/attention.py            # GPU sizes (T up to 8192, the paper's context)
    python benchmarks/attention.py --quick    # small CPU sizes
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memtrain.model.attention import attend, build_attention_mask, flex_available  # noqa: E402

FULL = [  # (batch, seq_len, heads, kv_heads, head_dim, mean document length)
    (8, 2048, 12, 12, 32, 512),
    (8, 8192, 12, 12, 32, 1024),  # OpenLM-160M shapes at the paper's context
    (4, 8192, 16, 16, 128, 1024),  # OpenLM-1B
    (4, 8192, 16, 4, 128, 1024),  # grouped-query variant
]
QUICK = [
    (2, 256, 4, 4, 32, 64),
    (2, 512, 4, 2, 32, 128),
]


def packed_doc_ids(batch: int, seq_len: int, mean_len: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """Document ids with boundaries drawn uniformly (about seq_len / mean_len documents per row)."""
    g = torch.Generator().manual_seed(seed)
    boundary = torch.rand(batch, seq_len, generator=g) < 1.0 / mean_len
    boundary[:, 0] = False
    return boundary.long().cumsum(-1).to(device)


def time_path(backend: str, q, k, v, doc_ids, repeats: int, warmup: int, backward: bool) -> float:
    """Median seconds of mask build + forward (+ backward)."""
    def run():
        with torch.set_grad_enabled(backward):
            mask = build_attention_mask(doc_ids, q.shape[2], backend, q.device)
            assert mask.backend == backend, f"{backend} resolved to {mask.backend}"
            out = attend(q, k, v, mask)
        if backward:
            out.backward(torch.ones_like(out))

    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        if q.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if q.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes for a CPU")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="bfloat16 (GPU default) or float32 (CPU default)")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()

    device = torch.device(args.device)
    if device.type == "cpu":  # eager (unfused) flex on CPU is expected here; its warning is noise
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    repeats = args.repeats or (3 if args.quick else 10)
    configs = QUICK if args.quick else FULL

    for batch, seq_len, heads, kv_heads, head_dim, mean_len in configs:
        g = torch.Generator(device=device).manual_seed(0)
        # Flex has no CPU backward, so on CPU every path is timed forward-only to keep the ratio fair.
        backward = device.type != "cpu"

        def tensor(h):
            x = torch.randn(batch, h, seq_len, head_dim, device=device, dtype=dtype, generator=g)
            return x.requires_grad_(backward)

        q, k, v = tensor(heads), tensor(kv_heads), tensor(kv_heads)
        doc_ids = packed_doc_ids(batch, seq_len, mean_len, device)
        record = {
            "config": {"batch": batch, "seq_len": seq_len, "heads": heads, "kv_heads": kv_heads,
                       "head_dim": head_dim, "mean_doc_len": mean_len, "dtype": str(dtype).replace("torch.", "")},
            "device": device_name,
            "timed": "forward+backward" if backward else "forward",
            "torch": torch.__version__,
            "docs_per_row": float((doc_ids[:, -1] + 1).float().mean()),
        }
        record["sdpa_causal_no_docs_s"] = time_path("sdpa", q, k, v, None, repeats, 1, backward)
        record["sdpa_dense_mask_s"] = time_path("sdpa", q, k, v, doc_ids, repeats, 1, backward)
        if flex_available():
            try:
                # Compiling flex on CUDA takes a while: warm up twice so compile time is excluded.
                record["flex_s"] = time_path("flex", q, k, v, doc_ids, repeats, 2 if device.type == "cuda" else 1,
                                           backward)
                record["ratio_sdpa_over_flex"] = record["sdpa_dense_mask_s"] / record["flex_s"]
            except Exception as e:  # noqa: BLE001 - report, keep benchmarking the other configs
                record["flex_error"] = f"{type(e).__name__}: {e}"[:300]
        else:
            record["flex_error"] = "flex_attention not importable"
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
