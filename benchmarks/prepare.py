"""Throughput of the cluster-prefixed data path: embedding, tree training, assignment, packing and
writing (documents/s, from ``memtrain prepare``'s own stage timers), and the loader (samples/s).

    python benchmarks/prepare.py --quick        # CPU, about a minute: builtin corpus subset
    python benchmarks/prepare.py --docs 200000 --branching 16 --depth 4 --seq-len 2048

Prints one JSON line with the configuration, the device and the figures. Not part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from memtrain.config import recipe_from_dict
from memtrain.data.builtin import builtin_documents
from memtrain.data.loader import LoaderIterator, build_loader
from memtrain.data.prepare import prepare


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small corpus and tree for a CPU run in about a minute")
    ap.add_argument("--docs", type=int, default=None, help="documents (the built-in corpus, repeated if needed)")
    ap.add_argument("--branching", type=int, default=None)
    ap.add_argument("--depth", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--loader-batches", type=int, default=200)
    ap.add_argument("--micro-batch", type=int, default=16)
    args = ap.parse_args()
    quick = {"docs": 1500, "branching": 4, "depth": 2, "seq_len": 128, "vocab": 1024}
    full = {"docs": 11612, "branching": 16, "depth": 2, "seq_len": 512, "vocab": 4096}
    cfg = dict(quick if args.quick else full)
    for key in cfg:
        value = getattr(args, key)
        if value is not None:
            cfg[key] = value

    corpus = builtin_documents(0)
    docs = [corpus[i % len(corpus)] + ("" if i < len(corpus) else f" (copy {i // len(corpus)})")
            for i in range(cfg["docs"])]
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "docs.jsonl"
        src.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
        recipe = recipe_from_dict({
            "run": {"name": "bench", "seed": 0},
            "model": {"vocab_size": cfg["vocab"], "max_seq_len": cfg["seq_len"]},
            "data": {"dir": str(Path(tmp) / "data"), "sources": [str(src)], "seq_len": cfg["seq_len"],
                     "val_fraction": 0.0, "tokenizer": {"vocab_size": cfg["vocab"]},
                     "clustering": {"enabled": True, "branching": cfg["branching"], "depth": cfg["depth"],
                                    "kmeans_samples": 6400, "kmeans_steps": 20}},
            "train": {"global_batch_tokens": args.micro_batch * cfg["seq_len"], "micro_batch_size": args.micro_batch},
        })
        t = time.perf_counter()
        meta = prepare(recipe)
        prepare_s = time.perf_counter() - t
        report = json.loads((recipe.data_dir / "prepare_report.json").read_text())

        it = LoaderIterator(build_loader(recipe, "train", args.micro_batch))
        next(it)  # first batch opens shards
        t = time.perf_counter()
        for _ in range(args.loader_batches):
            next(it)
        loader_sps = args.loader_batches * args.micro_batch / (time.perf_counter() - t)

    print(json.dumps({
        "benchmark": "prepare",
        "config": cfg,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({platform.processor() or platform.machine()})",
        "documents": report["documents"],
        "sequences": report["sequences"],
        "documents_per_s": report["documents_per_s"],
        "loader_samples_per_s": round(loader_sps, 1),
        "prepare_seconds": round(prepare_s, 2),
        "max_cluster_fraction": report["max_cluster_fraction"],
        "python": sys.version.split()[0],
    }))


if __name__ == "__main__":
    main()
