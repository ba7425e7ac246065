"""The `memtrain` command line.

    memtrain train   RECIPE [key=value ...]            train, or resume the run in run.dir
    memtrain prepare RECIPE [key=value ...] [--force]  tokenize and write MDS shards into data.dir
    memtrain prepare RECIPE [key=value ...] --verify   check the prepared files against their checksums
    memtrain recipe show RECIPE [key=value ...]        resolved recipe, DeepSpeed config, parameters, peak memory
    memtrain submit  RECIPE [key=value ...] [--dry-run] write an sbatch script and submit it to Slurm
    memtrain status  RUN_DIR                           a run's progress, checkpoints, attempts and restarts
    memtrain scaling RUN_DIR [RUN_DIR ...] [--out DIR] tokens/s, MFU and scaling efficiency of several runs
    memtrain eval    RECIPE [key=value ...] [checkpoint=PATH] [--batches N] [--out FILE] [--modes M,...]
                     [--tasks T,...] [--lengths N,...] [--samples N] [--max-new-tokens N]
                                                       val perplexity, long-tail fact probes and long-context
                                                       tasks (S-NIAH, BABILong-style) of a checkpoint
    memtrain generate RECIPE [key=value ...] [checkpoint=PATH] --prompt TEXT [--prompt TEXT ...]
                     [--max-new-tokens N] [--context-bank {on,off}] [--bank-capacity N] [--answer TEXT]
                                                       greedy generation over prompts in order, carrying
                                                       them in the inference-time context bank

Overrides (``key=value``) may stand anywhere after the sub-command, before or after its flags. Errors the
user can fix are printed as one line and exit with code 2; `memtrain train` exits 3 when training
diverged and 4 when another rank hung or died. A run stopped by SIGTERM or SIGUSR1 (preemption) exits 0
after its checkpoint, with every rank (so that srun's --kill-on-bad-exit kills nobody mid-save); it
records how it ended in run.dir/attempts.jsonl (`memtrain status`), which the Slurm batch script reads
to requeue the job.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

from memtrain.config import RecipeError
from memtrain.errors import MemtrainError, is_path_failure, is_storage_failure, path_line

CHECKPOINT_KEY = "checkpoint"


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
    how = sp.add_mutually_exclusive_group()
    how.add_argument("--force", action="store_true", help="replace data.dir prepared with other settings")
    how.add_argument("--verify", action="store_true",
                     help="prepare nothing: check every shard, the tokenizer and the cluster tree of the prepared "
                          "data.dir against the size and checksum recorded at preparation (exit 2 naming the "
                          "damaged files)")
    rp = sub.add_parser("recipe", help="inspect recipes")
    rsub = rp.add_subparsers(dest="recipe_command", required=True, metavar="ACTION")
    sp = rsub.add_parser("show", help="print the resolved recipe, its DeepSpeed config, parameter count and an "
                                      "estimate of the peak memory per GPU")
    recipe_args(sp)
    sp.add_argument("--world-size", type=int, default=None,
                    help="data-parallel ranks to resolve the DeepSpeed config for (default: slurm.nodes x "
                         "slurm.gpus_per_node on a GPU recipe's cluster, 1 otherwise)")
    sp = sub.add_parser("submit", help="write an sbatch script for the recipe and submit it with sbatch")
    recipe_args(sp)
    sp.add_argument("--dry-run", action="store_true", help="print the script; write and submit nothing")
    sp = sub.add_parser("status", help="a run's last step, loss, throughput, checkpoints, attempts and restarts")
    sp.add_argument("run_dir", metavar="RUN_DIR", help="the run's run.dir")
    sp = sub.add_parser("scaling", help="compare runs of one recipe on different numbers of ranks: a Markdown "
                        "table and a PNG of tokens/s per device, MFU, scaling efficiency, step-time split and "
                        "traffic per step")
    sp.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="the runs' run.dir folders")
    sp.add_argument("--out", default=".", metavar="DIR", help="where scaling.md and scaling.png go (default: .)")
    sp = sub.add_parser("eval", help="evaluate a checkpoint: val perplexity (fetched / generic memory), the "
                        "builtin:longtail fact probes (fetched, generic, blocked, corrupted retrieval) and the "
                        "long-context tasks (S-NIAH, BABILong-style qa1-qa5)",
                        description="Evaluate a checkpoint in one process. checkpoint=PATH (a run dir or its "
                        "checkpoints/global_stepN) picks it; default: the newest complete checkpoint in run.dir. "
                        "Other key=value overrides apply to the recipe as in `memtrain train`. Long-context tasks "
                        "(generated offline, greedy generation, whole-word answer match) run by default for "
                        "model.type titans and memory.type memory_llama, for other models with --tasks.")
    recipe_args(sp)
    sp.add_argument("--batches", type=_non_negative_int, default=None, metavar="N",
                    help="val micro-batches for perplexity, evenly spaced over the split (default "
                         "train.eval.batches, where 0 is the whole split; --batches 0 skips it)")
    sp.add_argument("--out", default=None, metavar="FILE",
                    help="JSON report path (default <run dir>/eval/<checkpoint tag>.json)")
    sp.add_argument("--modes", default=None, metavar="M,...",
                    help="comma-separated memory modes (default: fetched, generic, blocked, corrupt_from_level_p.."
                         "1 with memories; none without)")
    sp.add_argument("--tasks", default=None, metavar="T,...",
                    help="long-context tasks: niah (passkey, number, word needles; RULER S-NIAH), babilong "
                         "(qa1-qa5 fact chaining), single task names, or none (default: niah,babilong for "
                         "model.type titans and memory.type memory_llama, none otherwise)")
    sp.add_argument("--lengths", default=None, metavar="N,...",
                    help="prompt lengths in tokens of the run's tokenizer, 2K = 2048 (default 512,1024: small "
                         "enough for the tiny CPU models; the Titans paper uses 2K,4K,8K,16K). Titans models read "
                         "longer prompts in max_seq_len calls carrying their memory; other models keep the last "
                         "tokens that fit their context (counted as truncated)")
    sp.add_argument("--samples", type=int, default=None, metavar="N",
                    help="examples per task and length (default 5; S-NIAH needles at N evenly spaced depths)")
    sp.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                    help="greedy tokens generated per example, stopping at end-of-text (default 16)")
    sp = sub.add_parser("generate", help="greedy generation over prompts in order, with the inference-time "
                        "context bank (crossattn-memory-banks Section 7) carrying earlier prompts",
                        description="Load a checkpoint as `memtrain eval` does and run the prompts in order: "
                        "each is answered greedily with the memory cross-attention layers reading the context bank "
                        "(the earlier prompts, compressed), then compressed and added to it; prints the generated "
                        "text and the bank's state. The context encoder is fitted at start on the run's val text "
                        "(or loaded from --encoder FILE). Needs model.type decoder with memory.type crossattn "
                        "unless --context-bank off.")
    recipe_args(sp)
    sp.add_argument("--prompt", action="append", required=True, metavar="TEXT",
                    help="a prompt; repeat for several, run in the order given")
    sp.add_argument("--max-new-tokens", type=int, default=None, metavar="N",
                    help="greedy tokens generated per prompt, stopping at end-of-text (default 16)")
    sp.add_argument("--context-bank", choices=("on", "off"), default="on",
                    help="read and write the context bank (default on); off generates with the model alone")
    sp.add_argument("--bank-capacity", type=int, default=None, metavar="N",
                    help="context vectors kept before importance-weighted merging starts (default 64)")
    sp.add_argument("--answer", default=None, metavar="TEXT",
                    help="report the mean per-token log-probability of TEXT as each prompt's continuation, with "
                         "the context bank and without it")
    sp.add_argument("--encoder", default=None, metavar="FILE",
                    help="load the context encoder from FILE when it exists; otherwise fit it and save it there")
    sp.add_argument("--encoder-steps", type=_non_negative_int, default=None, metavar="N",
                    help="steps fitting the context encoder on the val text's hidden states (default 300)")
    sp.add_argument("--tokens-per-vector", type=int, default=None, metavar="N",
                    help="prompt tokens compressed into one context vector when fitting (default 8)")
    sp.add_argument("--top-k-clusters", type=int, default=None, metavar="N",
                    help="context-bank clusters each query token reads (default 2)")
    sp.add_argument("--out", default=None, metavar="FILE", help="also write the report as JSON to FILE")
    return p


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def recipe_show(recipe, world_size: Optional[int]) -> str:
    """The text of `memtrain recipe show`."""
    import torch

    from memtrain.model import build, count_parameters
    from memtrain.parallel.engine import deepspeed_config
    from memtrain.parallel.memory_estimate import estimate_peak_memory, format_memory_estimate

    if world_size is None:
        world_size = 1
    with torch.device("meta"):
        model = build(recipe.model, recipe.memory, recipe.data.clustering.branching)
    precision = "fp32" if recipe.parallel.precision == "fp32" else "bf16"
    lines = ["# resolved recipe", recipe.to_yaml().rstrip(), "",
             f"# DeepSpeed config for {world_size} rank(s) ({precision}; parallel.precision=auto picks fp32 on CPU)",
             json.dumps(deepspeed_config(recipe, world_size, precision), indent=2), "",
             f"model parameters: {count_parameters(model) - _generic_parameters(model)}",
             *memory_lines(model),
             *(model.describe() if hasattr(model, "describe") else []),
             f"tokens per step: {recipe.tokens_per_step} ({recipe.sequences_per_step} sequences of {recipe.data.seq_len})",
             f"max steps: {recipe.max_steps} ({recipe.max_steps * recipe.tokens_per_step} tokens)",
             *format_memory_estimate(estimate_peak_memory(recipe, world_size, precision, model), world_size,
                                     precision, recipe.parallel.zero_stage)]
    return "\n".join(lines)


def _generic_parameters(model) -> int:
    """The generic memory's parameters (hierarchical memories); MemoryLlama's memory is described apart."""
    if getattr(model, "memory_llama", None) is not None or getattr(model, "crossattn", None) is not None:
        return 0  # described apart (memory_lines); counted in the model's parameters
    memory = getattr(model, "memory_parameters", None)
    return sum(p.numel() for p in memory()) if memory is not None else 0


def memory_lines(model) -> list[str]:
    """Hierarchical memories: ``fetched memory parameters`` (sum_l s_l) and ``memory bank parameters``
    (sum_l s_l k^l). Cross-attention memories: the banks and one memory layer's parameters."""
    crossattn = getattr(model, "crossattn", None)
    if crossattn is not None:
        n = crossattn.parameter_counts()
        c = crossattn.cfg
        return [f"cross-attention memory bank parameters: {n['bank']} ({n['banks']} bank(s) of {c.tokens} tokens"
                + (f", {c.chapters} chapters of {c.chapter_tokens}" if c.chapters > 1 else "") + ")",
                f"cross-attention memory parameters per layer: {n['per_layer']} (x {n['layers']} layers "
                f"{crossattn.layer_indices}, variant {c.variant})",
                f"cross-attention memory parameters in all: {n['total']}"]
    layout = getattr(model, "memory_layout", None)
    if layout is None:
        return []
    return [f"generic memory parameters: {_generic_parameters(model)} (one block per level, part of the model)",
            f"fetched memory parameters: {layout.fetched_parameters}",
            f"memory bank parameters: {layout.bank_parameters}",
            f"memory block sizes (s_l = c0 r_l, c0 = {layout.c0}): "
            + ", ".join(str(layout.block_size(l)) for l in range(layout.depth))]


def prepare_summary(recipe, report: dict) -> str:
    c = report["counts"]
    head = (f"{report['status']} {recipe.data_dir}: {c['documents']:,} documents ({c['skipped_empty']} empty skipped) -> "
            f"{report['train_samples']:,} train / {report['val_samples']:,} val sequences of {report['seq_len']} tokens, "
            f"vocabulary {report['vocab_size']} (tokenizer {report['tokenizer']})")
    if "seconds" in report:
        head += f" in {report['seconds']:.1f} s ({report['documents_per_s']:,.0f} documents/s)"
    return head + f"\ndetails: {recipe.data_dir / 'meta.json'}"


def prepare_verify(recipe, recipe_arg: str, shown: int = 3) -> str:
    """`memtrain prepare RECIPE --verify`: the summary line of a clean folder; DataError naming the first
    ``shown`` damaged files (after printing the summary) otherwise."""
    from memtrain.data.verify import verify_folder
    from memtrain.errors import DataError

    data_dir = recipe.data_dir
    report = verify_folder(data_dir, progress=True)
    mb = report.bytes / 1e6
    line = (f"verified {data_dir}: {report.files} files, {mb:,.1f} MB hashed in {report.seconds:.2f} s "
            f"({mb / max(report.seconds, 1e-9):,.0f} MB/s); {len(report.unchecked)} without checksum")
    if report.unchecked:
        line += (" (prepared before checksums were recorded: sizes checked only; `memtrain prepare "
                 f"{recipe_arg} --force` records them)")
    if not report.problems:
        return line
    print(line + f"; {len(report.problems)} damaged", flush=True)
    n = len(report.problems)
    more = f" (and {n - shown} more)" if n > shown else ""
    raise DataError(f"{n} damaged file(s) in {data_dir}: {'; '.join(report.problems[:shown])}{more}; prepare the "
                    f"data again with `memtrain prepare {recipe_arg} --force`, or restore the folder from a good copy")


def split_checkpoint_override(overrides: Sequence[str]) -> tuple[list[str], Optional[str]]:
    """Take ``checkpoint=PATH`` out of the ``key=value`` overrides (it is not a recipe key; dotted keys
    such as ``checkpoint.keep_last=3`` stay). Returns (the other overrides, PATH or None)."""
    rest: list[str] = []
    path: Optional[str] = None
    for item in overrides:
        key, sep, value = item.partition("=")
        if sep and key.strip() == CHECKPOINT_KEY:
            if not value.strip():
                raise RecipeError("", "checkpoint= needs a path: a run directory or one of its "
                                  "checkpoints/global_stepN folders")
            path = value.strip()
        else:
            rest.append(item)
    return rest, path


def parse(argv: Optional[list[str]] = None) -> argparse.Namespace:
    """Parse the command line; ``key=value`` overrides are taken wherever they stand (argparse alone
    takes them only before the sub-command's flags)."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    takes_overrides = hasattr(args, "overrides")
    stray = [a for a in extra if not takes_overrides or a.startswith("-") or "=" not in a]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if takes_overrides:
        args.overrides = [*args.overrides, *extra]
    return args


def run(argv: Optional[list[str]] = None) -> int:
    args = parse(argv)
    if args.command == "status":
        from memtrain.launcher.reports import format_status, run_status

        print(format_status(run_status(args.run_dir)), flush=True)
        return 0
    if args.command == "scaling":
        from memtrain.launcher.reports import scaling_report

        report = scaling_report(args.run_dirs, args.out)
        with open(report["markdown"], encoding="utf-8") as f:
            print(f.read().rstrip(), flush=True)
        print(f"\nwrote {report['markdown']} and {report['png']}", flush=True)
        return 0
    from memtrain.config import load_recipe

    overrides, checkpoint = args.overrides, None
    if args.command in ("eval", "generate"):  # checkpoint=PATH names what to load; it is not a recipe key
        overrides, checkpoint = split_checkpoint_override(args.overrides)
    recipe = load_recipe(args.recipe, overrides)
    if args.command in ("eval", "generate") and args.out is not None:
        check_out_file(args.out)
    if args.command == "generate" and args.encoder is not None and not os.path.isfile(args.encoder):
        check_out_file(args.encoder, "--encoder")  # written after the fit, which may take minutes
    if args.command == "train":
        from memtrain.launcher.train import train

        train(recipe)
    elif args.command == "prepare" and args.verify:
        import shlex

        # the fix names the command as given: without its overrides it would prepare another data.dir
        print(prepare_verify(recipe, " ".join(shlex.quote(a) for a in (args.recipe, *args.overrides))), flush=True)
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
    elif args.command == "eval":
        from memtrain.eval.evaluate import evaluate, format_table

        modes = [m.strip() for m in args.modes.split(",") if m.strip()] if args.modes is not None else None
        report = evaluate(recipe, checkpoint, batches=args.batches, out=args.out, modes=modes, tasks=args.tasks,
                          lengths=args.lengths, samples=args.samples, max_new_tokens=args.max_new_tokens)
        print(format_table(report), flush=True)
    elif args.command == "generate":
        from memtrain.launcher.generate import generate

        generate(recipe, args.prompt, checkpoint, max_new_tokens=args.max_new_tokens, context_bank=args.context_bank,
                 bank_capacity=args.bank_capacity, answer=args.answer, encoder=args.encoder,
                 encoder_steps=args.encoder_steps, tokens_per_vector=args.tokens_per_vector,
                 top_k=args.top_k_clusters, out=args.out)
    return 0


def check_out_file(out: str, flag: str = "--out") -> None:
    """Before an evaluation or generation that may run for hours: ``--out`` (or another ``flag`` naming a file to
    write) must be a file path whose folder this user may write in. The nearest folder on its path that exists
    takes a probe file (created and removed at once; folders that do not exist yet are made at the end, as
    before). :class:`MemtrainError` otherwise, one line; nothing is left behind."""
    import tempfile
    from pathlib import Path

    path = Path(out).expanduser().absolute()
    if path.is_dir():
        example = Path(out) / ("report.json" if flag == "--out" else "encoder.pt")
        raise MemtrainError(f"{flag} {out} is a folder; give the path of the file to write, e.g. {example}")
    folder = path.parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise MemtrainError(f"{flag} {out}: {folder} is a file, not a folder; choose another {flag}")
    try:
        fd, probe = tempfile.mkstemp(prefix=".memtrain-out-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        if is_path_failure(e) or is_storage_failure(e):
            raise MemtrainError(f"{flag} {out} cannot be written: {e.strerror} in {folder}; choose another {flag}, or "
                                "fix that folder (its permissions, or space on its file system)") from None
        raise


def release_process_groups() -> None:
    """Destroy every torch.distributed process group this process started, before the interpreter exits. Left to
    interpreter finalisation, gloo's worker threads may still hold pending work and a rank that finished cleanly
    aborts ("terminate called without an active exception", SIGABRT): torchrun then reports the run failed (seen
    in CI on a 2-rank sharded cross-attention run, after its last checkpoint), and a Slurm job would not requeue
    as it should. This frees the groups only because ``dist.init`` first imports the modules that would keep the
    default group alive (:func:`memtrain.parallel.dist.import_group_capturers`). Never raises; a no-op where
    torch.distributed was never imported (it is not imported here)."""
    if "torch.distributed" not in sys.modules:
        return
    from memtrain.parallel import dist

    try:
        dist.shutdown()
    except Exception:  # the command's own outcome (its exit code, its one-line error) comes first
        pass


def _error_line(line: str) -> None:
    """``line`` on stderr in one write: print's two (the text, then the newline) let the ranks of a distributed
    command run their lines together ("...(on rank 0)memtrain: ...")."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def main(argv: Optional[list[str]] = None) -> int:
    try:
        return run(argv)
    except MemtrainError as e:
        if not e.printed_by_another_rank:
            _error_line(f"memtrain: {e}")
        return e.exit_code
    except OSError as e:  # a full, over-quota or read-only disk (training says more: StorageError), or a path
        if is_path_failure(e):  # this user may not use
            _error_line(f"memtrain: {path_line(e)}")
            return MemtrainError.exit_code
        if not is_storage_failure(e):
            raise
        what = f"writing {e.filename} failed" if e.filename else "a write failed"
        _error_line(f"memtrain: {what}: {e.strerror}; free space on the file system it writes to (data.dir for "
                    "prepare, run.dir for train, --out for eval and generate) or write elsewhere, and run the command "
                    "again")
        return MemtrainError.exit_code
    except KeyboardInterrupt:
        return 130
    finally:
        release_process_groups()


if __name__ == "__main__":
    sys.exit(main())
