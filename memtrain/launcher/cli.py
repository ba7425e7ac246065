"""The `memtrain` command line.

    memtrain train   RECIPE [key=value ...]            train, or resume the run in run.dir
    memtrain prepare RECIPE [key=value ...] [--force]  tokenize and write MDS shards into data.dir
    memtrain recipe show RECIPE [key=value ...]        resolved recipe, DeepSpeed config, parameters
    memtrain submit  RECIPE [key=value ...] [--dry-run] write an sbatch script and submit it to Slurm

Errors the user can fix are printed as one line and exit with code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

from memtrain.errors import MemtrainError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="memtrain", description="Pretrain language models with memory on DeepSpeed.")
    # The DeepSpeed launcher passes --local_rank=N before the sub-command; LOCAL_RANK carries the same.
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def recipe_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("recipe", help="YAML recipe")
        sp.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. train.max_steps=20")

    sp = sub.add_parser("train", help="train, or resume from the newest complete checkpoint in run.dir")
    recipe_args(sp)
    sp = sub.add_parser("prepare", help="tokenize a corpus and write MDS shards into data.dir")
    recipe_args(sp)
    sp.add_argument("--force", action="store_true", help="replace data.dir prepared with other settings")
    rp = sub.add_parser("recipe", help="inspect recipes")
    rsub = rp.add_subparsers(dest="recipe_command", required=True, metavar="ACTION")
    sp = rsub.add_parser("show", help="print the resolved recipe, its DeepSpeed config and parameter count")
    recipe_args(sp)
    sp.add_argument("--world-size", type=int, default=None,
                    help="data-parallel ranks to resolve the DeepSpeed config for (default: slurm.nodes x "
                         "slurm.gpus_per_node on a GPU recipe's cluster, 1 otherwise)")
    sp = sub.add_parser("submit", help="write an sbatch script for the recipe and submit it with sbatch")
    recipe_args(sp)
    sp.add_argument("--dry-run", action="store_true", help="print the script; write and submit nothing")
    return p


def recipe_show(recipe, world_size: Optional[int]) -> str:
    """The text of `memtrain recipe show`."""
    import torch

    from memtrain.model import build, count_parameters
    from memtrain.parallel.engine import deepspeed_config

    if world_size is None:
        world_size = 1
    with torch.device("meta"):
        model = build(recipe.model, recipe.memory)
    precision = "fp32" if recipe.parallel.precision == "fp32" else "bf16"
    lines = ["# resolved recipe", recipe.to_yaml().rstrip(), "",
             f"# DeepSpeed config for {world_size} rank(s) ({precision}; parallel.precision=auto picks fp32 on CPU)",
             json.dumps(deepspeed_config(recipe, world_size, precision), indent=2), "",
             f"model parameters: {count_parameters(model)}",
             f"tokens per step: {recipe.tokens_per_step} ({recipe.sequences_per_step} sequences of {recipe.data.seq_len})",
             f"max steps: {recipe.max_steps} ({recipe.max_steps * recipe.tokens_per_step} tokens)"]
    return "\n".join(lines)


def prepare_summary(recipe, report: dict) -> str:
    c = report["counts"]
    head = (f"{report['status']} {recipe.data_dir}: {c['documents']:,} documents ({c['skipped_empty']} empty skipped) -> "
            f"{report['train_samples']:,} train / {report['val_samples']:,} val sequences of {report['seq_len']} tokens, "
            f"vocabulary {report['vocab_size']} (tokenizer {report['tokenizer']})")
    if "seconds" in report:
        head += f" in {report['seconds']:.1f} s ({report['documents_per_s']:,.0f} documents/s)"
    return head + f"\ndetails: {recipe.data_dir / 'meta.json'}"


def run(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    from memtrain.config import load_recipe

    recipe = load_recipe(args.recipe, args.overrides)
    if args.command == "train":
        from memtrain.launcher.train import train

        train(recipe)
    elif args.command == "prepare":
        from memtrain.data.prepare import prepare

        report = prepare(recipe, force=args.force)
        if os.environ.get("RANK", "0") == "0":  # distributed prepare: every rank returns the same report
            print(prepare_summary(recipe, report))
    elif args.command == "recipe":
        world = args.world_size
        if world is None and recipe.parallel.precision == "bf16":
            world = recipe.slurm.nodes * recipe.slurm.gpus_per_node
        print(recipe_show(recipe, world))
    elif args.command == "submit":
        from memtrain.launcher.submit import submit

        print(submit(recipe, args.recipe, args.overrides, dry_run=args.dry_run))
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    try:
        return run(argv)
    except MemtrainError as e:
        print(f"memtrain: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
