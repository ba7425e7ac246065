"""`memtrain generate RECIPE [key=value ...] [checkpoint=PATH] --prompt TEXT [--prompt TEXT ...]`: greedy
generation over a sequence of prompts with the inference-time context bank (crossattn-memory-banks
paper, Section 2 "Future extension" and Section 7; :mod:`memtrain.model.crossattn.context_bank`).

The checkpoint is loaded as `memtrain eval` loads it (one process, no DeepSpeed: verified against its
``COMPLETE.json``, weights loaded strictly, eval mode, held against pruning while read). The prompts then
run in order; for each one:

1. greedy generation (:func:`memtrain.eval.longctx.greedy_generate`) with the memory layers reading the
   context bank as it stands (the earlier prompts), and, with ``--answer TEXT``, the mean per-token
   log-probability of TEXT as the prompt's continuation with the context bank and without it;
2. the prompt's first- and last-layer hidden states (computed without the context bank) are compressed
   by the context encoder (eq. 22) and added to the bank, which ages its vectors by one run, merges
   under capacity pressure (eq. 23-24) and updates its clusters;
3. the generated text and the bank's state (vectors, clusters, merges, where this prompt's reads went)
   are printed.

The context encoder is fitted at start on the hidden states of the run's own validation text
(``--encoder-steps`` Adam steps, default 300, on at most ``ENCODER_TOKENS`` tokens of the val split;
about 2 s on a CPU for the tiny recipes: one forward per val micro-batch plus the steps of a
two-layer MLP), or loaded from ``--encoder FILE`` when that file exists (it is written there after a
fit otherwise). A file fitted on another checkpoint is refused: its latents would not describe this
checkpoint's hidden states.

A demonstration that can be checked (the bank carrying a fact across prompts)::

    memtrain generate RECIPE --prompt "The pass key is 4721. Remember it. 4721 is the pass key." \\
        --prompt "What is the pass key? The pass key is" --answer " 4721"

prompt 2 does not contain the fact; its answer line reports the log-probability of `` 4721`` with the
context bank (holding prompt 1) and without it. Whether the gain is the fact's and not a generic shift
is checked by a control: the same run with another key in prompt 1 must raise `` 4721`` less. The memory
layers were trained to read the learned bank only (nothing in training used a context bank), so how
much the context bank helps depends on the checkpoint; the command reports what it measures.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from memtrain.config import Recipe, RecipeError
from memtrain.errors import CheckpointError, DataError

DEFAULT_MAX_NEW_TOKENS = 16
DEFAULT_CAPACITY = 64
DEFAULT_ENCODER_STEPS = 300
DEFAULT_TOKENS_PER_VECTOR = 8
DEFAULT_TOP_K = 2
CLUSTER_SIZE = 8  # context vectors per cluster (ContextBank: k = ceil(N / CLUSTER_SIZE))
ENCODER_TOKENS = 32768  # val tokens whose hidden states the encoder is fitted on (at least 8 sequences)
ENCODER_FORMAT = "memtrain.context_encoder"


def check_generate(recipe: Recipe, prompts: Sequence[str], context_bank: str, max_new_tokens: Optional[int],
                   bank_capacity: Optional[int], encoder: Optional[str], encoder_steps: Optional[int],
                   tokens_per_vector: Optional[int], top_k: Optional[int]) -> None:
    """RecipeError for every setting that cannot work, before anything is loaded."""
    if not prompts or any(not p.strip() for p in prompts):
        raise RecipeError("", "--prompt needs a non-empty text; give one --prompt per prompt, in order")
    if context_bank not in ("on", "off"):
        raise RecipeError("", f"--context-bank must be on or off, got {context_bank!r}")
    for flag, value in (("--max-new-tokens", max_new_tokens), ("--bank-capacity", bank_capacity),
                        ("--tokens-per-vector", tokens_per_vector), ("--top-k-clusters", top_k)):
        if value is not None and value < 1:
            raise RecipeError("", f"{flag} must be >= 1, got {value}")
    if encoder_steps is not None and encoder_steps < 0:
        raise RecipeError("", f"--encoder-steps must be >= 0, got {encoder_steps}")
    if context_bank == "off":
        flags = (("--bank-capacity", bank_capacity), ("--encoder", encoder), ("--encoder-steps", encoder_steps),
                 ("--tokens-per-vector", tokens_per_vector), ("--top-k-clusters", top_k))
        given = [flag for flag, value in flags if value is not None]
        if given:
            raise RecipeError("", f"{', '.join(given)} set, but --context-bank is off")
        return
    if recipe.model.type != "decoder" or not recipe.memory.is_crossattn:
        raise RecipeError("memory.type", f"the context bank is read by the memory cross-attention layers of a "
                          f"memtrain decoder (model.type: decoder, memory.type: crossattn); this recipe has "
                          f"model.type {recipe.model.type!r}, memory.type {recipe.memory.type!r}: use "
                          "--context-bank off")
    if recipe.memory.crossattn.dim is not None and recipe.memory.crossattn.dim != recipe.model.d_model:
        raise RecipeError("memory.crossattn.dim", f"the memory layers read {recipe.memory.crossattn.dim}-wide bank "
                          f"tokens, but context vectors are d_model {recipe.model.d_model} wide; use "
                          "--context-bank off")


# --------------------------------------------------------------------------------------------------
# The context encoder: fitted on the run's validation text, or loaded


def _val_states(model: torch.nn.Module, recipe: Recipe, device: torch.device) -> torch.Tensor:
    """Hidden states ``[E^(1); E^(L_max)]`` of up to ``ENCODER_TOKENS`` val tokens: ``[N, T, 2d]`` on CPU."""
    from memtrain.data.loader import ValidationSet
    from memtrain.model.crossattn.context_bank import hidden_states

    micro = recipe.train.micro_batch_size
    sequences = max(8, ENCODER_TOKENS // recipe.data.seq_len)
    val = ValidationSet(recipe, micro, batches=math.ceil(sequences / micro))
    out = []
    with torch.no_grad():
        for batch in val:
            out.append(hidden_states(model, batch["input_ids"].to(device), batch["doc_ids"].to(device)).float().cpu())
    return torch.cat(out)


# The fix for an --encoder file that is not an encoder: it may be any file of the user's (a recipe, a checkpoint).
_OTHER_ENCODER = "pass another --encoder path (where none exists, one is fitted and saved there)"


def context_encoder(model: torch.nn.Module, recipe: Recipe, info: Any, device: torch.device, path: Optional[str],
                    steps: int, tokens_per_vector: Optional[int], echo: Callable[[str], None]) -> tuple[Any, dict]:
    """The context encoder for this checkpoint: loaded from ``path`` when it exists, else fitted on the
    val split's hidden states (and saved to ``path`` when given). Returns (encoder, how it was obtained)."""
    from memtrain.model.crossattn.context_bank import ContextEncoder, fit_context_encoder

    d = recipe.model.d_model
    if path is not None and Path(path).is_file():
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unreadable file is the same user error
            raise CheckpointError(f"--encoder {path} is not a context encoder file (unreadable: {type(e).__name__}); "
                                  f"{_OTHER_ENCODER}") from None
        if not isinstance(saved, dict) or saved.get("format") != ENCODER_FORMAT:
            raise CheckpointError(f"--encoder {path} is not a context encoder file; {_OTHER_ENCODER}")
        cfg = saved["config"]
        if saved.get("checkpoint") != str(info.path.resolve()) or cfg["d_model"] != d:
            raise CheckpointError(f"--encoder {path} was fitted on the hidden states of {saved.get('checkpoint')}, "
                                  f"not of {info.path}; delete it (a new one is fitted and saved there) or pass "
                                  "another path")
        if tokens_per_vector is not None and tokens_per_vector != cfg["tokens_per_vector"]:
            raise CheckpointError(f"--encoder {path} compresses {cfg['tokens_per_vector']} tokens per vector, not "
                                  f"--tokens-per-vector {tokens_per_vector}; drop the flag or pass another path")
        encoder = ContextEncoder(cfg["d_model"], cfg["tokens_per_vector"], cfg["hidden"])
        encoder.load_state_dict(saved["state"])
        encoder.to(device).eval()
        echo(f"context encoder: loaded {path} ({cfg['tokens_per_vector']} tokens per vector, reconstruction MSE "
             f"{saved['loss_first']:.3f} -> {saved['loss_last']:.3f} when fitted)")
        return encoder, {"source": str(path), "loss_first": saved["loss_first"], "loss_last": saved["loss_last"]}

    from tqdm.auto import tqdm

    start = time.perf_counter()
    torch.manual_seed(recipe.run.seed)
    states = _val_states(model, recipe, device)
    if states.shape[0] == 0:
        raise DataError(f"{recipe.data_dir} has no validation sequences to fit the context encoder on; prepare the "
                        "data with data.val_fraction > 0, or pass --encoder FILE fitted earlier")
    encoder = ContextEncoder(d, tokens_per_vector or DEFAULT_TOKENS_PER_VECTOR)
    encoder.set_statistics(states)
    with torch.no_grad():  # on the whole fitting set, before and after (standardised MSE, 1.0 = the mean)
        first = float(encoder.loss(states))
    with tqdm(total=steps, desc="fitting the context encoder", unit=" steps", disable=None) as bar:
        fit_context_encoder(encoder, states, steps=steps, seed=recipe.run.seed,
                            progress=lambda step, loss: bar.update(1))
    with torch.no_grad():
        last = float(encoder.loss(states))
    encoder.to(device).eval()
    seconds = time.perf_counter() - start
    echo(f"context encoder: fitted on {states.shape[0] * states.shape[1]:,} val tokens in {steps} steps "
         f"({seconds:.1f} s): reconstruction MSE {first:.3f} -> {last:.3f} (standardised; 1.0 = predicting the "
         f"mean), {encoder.r} tokens per vector")
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(f"{path}.tmp")
        try:
            torch.save({"format": ENCODER_FORMAT, "version": 1, "config": encoder.config(),
                        "checkpoint": str(info.path.resolve()), "step": info.step, "loss_first": first,
                        "loss_last": last, "state": {k: v.cpu() for k, v in encoder.state_dict().items()}}, tmp)
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)  # a failed save leaves nothing
        echo(f"context encoder: saved to {path}")
    return encoder, {"source": "fitted", "steps": steps, "tokens": int(states.shape[0] * states.shape[1]),
                     "seconds": round(seconds, 3), "loss_first": first, "loss_last": last}


# --------------------------------------------------------------------------------------------------
# Scoring


def answer_tokens(prompt_encoder: Any, prompt: str, prompt_ids: Sequence[int], answer: str) -> tuple[list[int], int]:
    """The tokens of ``prompt + answer``, encoded together as the model reads them, and the first answer
    position (:func:`memtrain.eval.common.answer_start`; ``prompt_ids`` = the prompt encoded alone). Until
    2026-11-30 the answer was encoded alone and appended, which for memtrain's tokenizer scored a word-start
    piece the text does not have (``" 4721"``: ``▁ ▁ 4 7 2 1`` after ``▁is``)."""
    from memtrain.eval.common import answer_start

    full = prompt_encoder.encode(prompt + answer)
    start = answer_start(full, prompt_ids)
    if start == 0 or start >= len(full):
        raise RecipeError("", f"--answer {_clip(answer)} adds no token after the prompt {_clip(prompt)} (or merges "
                              "with all of it); pass an answer that continues the prompt's text")
    return full, start


def answer_logprob(model: torch.nn.Module, tokens: Sequence[int], start: int, max_context: int,
                   device: torch.device, stream_tokens: Optional[int] = None) -> float:
    """Mean log-probability per token of ``tokens[start:]`` (the answer) as the continuation of
    ``tokens[:start]`` (the prompt): in one forward over the last ``max_context`` tokens, or for a model that
    streams (``stream_tokens``: Titans, :func:`memtrain.eval.longctx.reading_plan`) over the whole sequence
    in calls of ``stream_tokens`` with the memory carried, as generation reads the prompt. Until 2026-11-30
    a Titans prompt was cut to its last ``max_context`` tokens here while generation read all of it."""
    n = len(tokens) - start
    if stream_tokens is not None:
        seq = torch.tensor([list(tokens)], device=device)
        state, parts = None, []
        with torch.no_grad():
            for begin in range(0, seq.shape[1], stream_tokens):
                out = model(seq[:, begin:begin + stream_tokens], doc_ids=None, memory=state)
                state = out.memory
                if begin + stream_tokens > start - 1:  # holds a position that predicts an answer token
                    parts.append((begin, out.logits[0].float()))
        first = parts[0][0]
        logits = torch.cat([p for _, p in parts])[start - 1 - first:-1]
        target = seq[0, start:]
    else:
        window = list(tokens)[-max_context:]
        if n >= len(window):
            raise RecipeError("", f"--answer ({n} tokens) leaves no room for the prompt in {max_context} tokens")
        with torch.no_grad():
            logits = model(torch.tensor([window], device=device)).logits[0].float()[-n - 1:-1]
        target = torch.tensor(window[-n:], device=device)
    logp = torch.log_softmax(logits, dim=-1)
    return float(logp.gather(-1, target[:, None]).mean())


def _clip(text: str, n: int = 70) -> str:
    return repr(text if len(text) <= n else text[:n - 3] + "...")


def bank_lines(bank: Any, merges: Sequence[Any], added: int, prompt_tokens: int, r: int) -> list[str]:
    """The bank's state after a prompt was added, as printed lines."""
    s = bank.summary()
    lines = [f"  context bank: +{added} vector(s) from {prompt_tokens} tokens ({r} per vector); {s['vectors']}/"
             f"{s['capacity']} vectors in {s['clusters']} cluster(s) {s['cluster_sizes']}; {len(merges)} merge(s) "
             f"this prompt ({s['merges']} in all), {s['reclusters']} full re-clustering(s)"]
    for m in merges[:5]:
        lines.append(f"    merged #{m.victim} into #{m.into} (importance {m.importance:.3f}, "
                     f"cosine {m.similarity:.3f})")
    if len(merges) > 5:
        lines.append(f"    ... and {len(merges) - 5} more merges")
    by_source = ", ".join(f"prompt {k}: {v}" for k, v in s["vectors_by_source"].items())
    lines.append(f"    vectors holding each prompt (a merged vector holds several): {by_source}")
    return lines


# --------------------------------------------------------------------------------------------------
# Entry point


def generate(recipe: Recipe, prompts: Sequence[str], checkpoint: Optional[str | Path] = None, *,
             max_new_tokens: Optional[int] = None, context_bank: str = "on", bank_capacity: Optional[int] = None,
             answer: Optional[str] = None, encoder: Optional[str] = None, encoder_steps: Optional[int] = None,
             tokens_per_vector: Optional[int] = None, top_k: Optional[int] = None, out: Optional[str | Path] = None,
             echo: Callable[[str], None] = lambda line: print(line, flush=True)) -> dict[str, Any]:
    """Run ``prompts`` in order on ``recipe``'s checkpoint with (``context_bank="on"``) or without the
    context bank, printing through ``echo`` (module docstring); returns the report (also written as
    JSON to ``out`` when given)."""
    from memtrain.data.loader import data_location, read_meta
    from memtrain.data.verify import prepared_tokenizer
    from memtrain.eval.common import PromptEncoder, write_json_atomic
    from memtrain.eval.evaluate import find_checkpoint, load_model, pick_device
    from memtrain.eval.longctx import NO_CONTEXT_LIMIT, greedy_generate, reading_plan
    from memtrain.model.switches import check_kernels
    from memtrain.parallel import checkpoint as ckpt

    check_generate(recipe, prompts, context_bank, max_new_tokens, bank_capacity, encoder, encoder_steps,
                   tokens_per_vector, top_k)
    if answer is not None and not answer.strip():
        raise RecipeError("", "--answer needs a non-empty text")
    max_new = max_new_tokens or DEFAULT_MAX_NEW_TOKENS
    data_dir, remote = data_location(recipe)
    meta = read_meta(data_dir, recipe)  # DataError when `memtrain prepare` has not run
    tokenizer = prepared_tokenizer(data_dir, meta, remote)
    prompt_encoder = PromptEncoder(tokenizer)
    encoded = [prompt_encoder.encode(text) for text in prompts]
    # every prompt's answer tokens before the checkpoint loads: an answer that adds no token is one line at once
    answers = ([answer_tokens(prompt_encoder, text, ids, answer) for text, ids in zip(prompts, encoded)]
               if answer is not None else None)
    info = find_checkpoint(recipe, checkpoint)
    device = pick_device(recipe)
    check_kernels(recipe, device)  # kernel: triton where it cannot run is one line, not a traceback mid-forward
    with ckpt.reading(info):
        state = ckpt.read_trainer_state(info)
        ckpt.check_compatible(info, state, recipe, info.world_size)
        ckpt.verify(info)
        model, _ = load_model(recipe, info, device)
    # Titans: long prompts in calls with the memory carried, as eval reads them; None: a windowed decoder reads any
    # length
    stream, max_context = reading_plan(model, recipe)
    max_context = max_context or NO_CONTEXT_LIMIT
    echo(f"checkpoint {info.path} (step {info.step}) on {device}; context bank {context_bank}")

    report: dict[str, Any] = {"recipe": recipe.run.name, "checkpoint": {"path": str(info.path), "step": info.step},
                              "device": str(device), "context_bank": context_bank, "answer": answer, "prompts": []}
    bank = reader = enc = None
    if context_bank == "on":
        from memtrain.model.crossattn.context_bank import ContextBank, ContextRead

        enc, report["encoder"] = context_encoder(model, recipe, info, device, encoder,
                                                 DEFAULT_ENCODER_STEPS if encoder_steps is None else encoder_steps,
                                                 tokens_per_vector, echo)
        bank = ContextBank(recipe.model.d_model, bank_capacity or DEFAULT_CAPACITY, cluster_size=CLUSTER_SIZE,
                           top_k=top_k or DEFAULT_TOP_K, seed=recipe.run.seed)
        reader = ContextRead(model, bank)

    from memtrain.model.crossattn.context_bank import hidden_states

    try:
        for number, (text, ids) in enumerate(zip(prompts, encoded), start=1):
            with torch.no_grad():
                (new,), (truncated,) = greedy_generate(model, [ids], max_new, tokenizer.eot_id, max_context,
                                                       stream_tokens=stream, device=device,
                                                       token_limit=tokenizer.vocab_size)
            generated = tokenizer.decode(new)
            entry: dict[str, Any] = {"prompt": text, "tokens": len(ids), "truncated": truncated,
                                     "generated": generated}
            echo(f"[{number}/{len(prompts)}] prompt {_clip(text)} ({len(ids)} tokens"
                 + (", truncated to fit the context" if truncated else "") + ")")
            echo(f"  generated: {_clip(generated, 200)}")
            if bank is not None:
                read = bank.attention_by_source()
                entry["read_by_prompt"] = read
                echo("  context bank read: " + (", ".join(f"prompt {k} {100 * v:.1f}%" for k, v in read.items())
                                                if read else "nothing (empty)")
                     + " of this prompt's context attention")
            if answers is not None:
                tokens, start = answers[number - 1]
                entry["answer_tokens"] = len(tokens) - start
                if reader is not None:
                    with reader.not_recording():
                        on = answer_logprob(model, tokens, start, max_context, device, stream)
                        with reader.paused():
                            off = answer_logprob(model, tokens, start, max_context, device, stream)
                    entry["answer_logprob"] = {"on": on, "off": off}
                    echo(f"  answer {_clip(answer)} ({len(tokens) - start} tokens): mean log-prob per token "
                         f"{on:.4f} with the context bank, {off:.4f} without ({on - off:+.4f})")
                else:
                    off = answer_logprob(model, tokens, start, max_context, device, stream)
                    entry["answer_logprob"] = {"off": off}
                    echo(f"  answer {_clip(answer)} ({len(tokens) - start} tokens): mean log-prob per token "
                         f"{off:.4f} (no context bank)")
            if bank is not None:
                with reader.paused(), torch.no_grad():
                    states = hidden_states(model, torch.tensor([ids[-max_context:]], device=device))
                    latents = enc.compress(states[0])
                bank.end_run()
                merges = bank.add(latents, source=number)
                entry["bank"] = bank.summary()
                entry["merges"] = [m.__dict__ for m in merges]
                for line in bank_lines(bank, merges, latents.shape[0], min(len(ids), max_context), enc.r):
                    echo(line)
            report["prompts"].append(entry)
    finally:
        if reader is not None:
            reader.detach()
    if out is not None:
        write_json_atomic(Path(out), report)
        echo(f"wrote {out}")
    return report


__all__ = ["answer_logprob", "answer_tokens", "check_generate", "context_encoder", "generate"]
