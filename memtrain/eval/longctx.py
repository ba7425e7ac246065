"""Long-context evaluation for `memtrain eval`: single needle in a haystack (RULER-style S-NIAH:
passkey, number, word) and BABILong-style fact chaining (qa1-qa5), generated offline by
:mod:`memtrain.data.tasks` (Titans paper Sections 5.3-5.4), answered by greedy generation.

- Titans models read prompts longer than ``model.max_seq_len`` in calls of ``max_seq_len`` tokens,
  carrying the memory state across calls (``stream``; exact for MAC and LMM, the attention window of
  MAG / MAL restarts per call); every sample starts from the initial memory.
- Other models see a window: prompts longer than the context minus the new tokens keep their last
  tokens and are counted as truncated. A decoder with sliding-window attention
  (``model.attention_window``, Titans Section 5.2's SWA baseline) has no context limit and reads every
  prompt whole. MemoryLlama blocks start every forward from M_0
  (:func:`fresh_memory_per_forward`); a hierarchical-memory model uses its generic memory.

The command itself (checkpoint loading, the report) is :mod:`memtrain.eval.evaluate`; what the
evaluations share (prompt encoding, padding, result cells) is :mod:`memtrain.eval.common`.
Imports torch and numpy only at module level.
"""

from __future__ import annotations

import contextlib
import re
import sys
import time
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

from memtrain.config import Recipe, RecipeError
from memtrain.eval.common import (PromptEncoder, accuracy_cell, batch_memory, length_batches, padding_changes_logits,
                                  right_padded)

# --------------------------------------------------------------------------------------------------
# Long-context tasks: S-NIAH and BABILong-style qa1-qa5 (memtrain.data.tasks), greedy


TASK_GROUPS = {"niah": ("passkey", "number", "word"), "babilong": ("qa1", "qa2", "qa3", "qa4", "qa5")}
DEFAULT_TASKS = ("niah", "babilong")
DEFAULT_TASK_LENGTHS = (512, 1024)  # tokens; sized for the tiny CPU models (the Titans paper: 2K-16K)
DEFAULT_TASK_SAMPLES = 5
DEFAULT_MAX_NEW_TOKENS = 16
TASK_SEED = 0
TASK_BATCH_SIZE = 8
NO_CONTEXT_LIMIT = sys.maxsize  # for callers that slice by the context: model_context None
LOGITS_BUDGET = 2 * 2**30  # bytes of fp32 logits one generation forward may produce (caps the batch)


def long_context_by_default(recipe: Recipe) -> bool:
    """``model.type: titans`` and ``memory.type: memory_llama`` runs are evaluated on the long-context
    tasks unless ``--tasks none``; other models only when ``--tasks`` is given."""
    return recipe.model.type == "titans" or recipe.memory.type == "memory_llama"


def parse_tasks(spec: Optional[str | Sequence[str]]) -> list[str]:
    """Task names from ``"niah,babilong"``-style input: the groups ``niah`` (passkey, number, word) and
    ``babilong`` (qa1-qa5) or single task names, in order, without repeats; ``none`` (or nothing) is
    no task. RecipeError for unknown names."""
    from memtrain.data.tasks import TASKS

    items = spec.split(",") if isinstance(spec, str) else list(spec or [])
    out: list[str] = []
    for item in (str(i).strip().lower() for i in items):
        if not item or item == "none":
            continue
        if item in TASK_GROUPS:
            out += TASK_GROUPS[item]
        elif item in TASKS:
            out.append(item)
        else:
            raise RecipeError("", f"unknown long-context task {item!r} in --tasks; choose from niah, babilong, "
                              f"{', '.join(TASKS)} or none")
    return list(dict.fromkeys(out))


def parse_lengths(spec: Optional[str | Sequence[int]]) -> list[int]:
    """Prompt lengths in tokens from ``"512,1024"`` (``2K`` = 2048, as in RULER); RecipeError unless
    every one is a whole number >= 64."""
    items = spec.split(",") if isinstance(spec, str) else list(spec if spec is not None else DEFAULT_TASK_LENGTHS)
    out = []
    for item in items:
        text = str(item).strip()
        if not text:
            continue
        m = re.fullmatch(r"(\d+)\s*([kK])?", text)
        if m is None:
            raise RecipeError("", f"--lengths: {text!r} is not a whole number of tokens (e.g. 512,1024 or "
                              "2K,4K,8K,16K)")
        n = int(m.group(1)) * (1024 if m.group(2) else 1)
        if n < 64:
            raise RecipeError("", f"--lengths: {n} is too short for the tasks' prompts; use 64 tokens or more")
        out.append(n)
    if not out:
        raise RecipeError("", "--lengths is empty; give prompt lengths in tokens, e.g. 512,1024")
    return list(dict.fromkeys(out))


def niah_depths(samples: int) -> list[float]:
    """Needle depths for ``samples`` S-NIAH examples per task and length: evenly spaced over [0, 1]
    (0.5 for one sample)."""
    if samples == 1:
        return [0.5]
    return [round(i / (samples - 1), 4) for i in range(samples)]


def check_long_context(recipe: Recipe, tasks: Optional[str | Sequence[str]], lengths: Optional[str | Sequence[int]],
                       samples: Optional[int], max_new_tokens: Optional[int]) -> tuple[list[str], list[int], int, int]:
    """The long-context settings of an evaluation: (task names, lengths, samples, max new tokens).
    ``tasks`` None: ``niah,babilong`` for :func:`long_context_by_default` models, none otherwise.
    RecipeError for unknown tasks, bad lengths, counts < 1, or settings given with no task to run."""
    if tasks is None:
        names = parse_tasks(DEFAULT_TASKS) if long_context_by_default(recipe) else []
    else:
        names = parse_tasks(tasks)
    given = [flag for flag, value in (("--lengths", lengths), ("--samples", samples),
                                      ("--max-new-tokens", max_new_tokens)) if value is not None]
    if not names and given:
        why = ("--tasks none" if tasks is not None else
               f"model.type {recipe.model.type!r} runs them only when --tasks is given, e.g. --tasks niah,babilong")
        raise RecipeError("", f"{', '.join(given)} set, but no long-context task runs ({why})")
    lengths_out = parse_lengths(lengths)
    samples = DEFAULT_TASK_SAMPLES if samples is None else int(samples)
    max_new = DEFAULT_MAX_NEW_TOKENS if max_new_tokens is None else int(max_new_tokens)
    if samples < 1:
        raise RecipeError("", f"--samples must be >= 1, got {samples}")
    if max_new < 1:
        raise RecipeError("", f"--max-new-tokens must be >= 1, got {max_new}")
    return names, lengths_out, samples, max_new


def task_examples(tasks: Sequence[str], lengths: Sequence[int], samples: int, encoder: PromptEncoder,
                  seed: int = TASK_SEED) -> list[dict]:
    """``samples`` examples per task and length (:func:`memtrain.data.tasks.generate`, whose
    prompts fit ``length`` tokens of ``encoder``): S-NIAH with its needles at :func:`niah_depths`,
    BABILong with the facts where they land. Deterministic in the arguments."""
    from memtrain.data.tasks import NIAH_TASKS, generate

    extra = len(encoder.prefix)
    out = []
    for task in tasks:
        for length in lengths:
            try:
                if task in NIAH_TASKS:
                    batch = generate(task, 1, lengths=[length - extra], depths=niah_depths(samples), seed=seed,
                                     length_fn=encoder.count)
                else:
                    batch = generate(task, samples, lengths=[length - extra], seed=seed, length_fn=encoder.count)
            except ValueError as e:
                need = re.search(r"\((\d+)\)", str(e))
                raise RecipeError("", f"--lengths: {length} tokens is too short for {task}'s question and facts"
                                  + (f" ({int(need.group(1)) + extra} tokens)" if need else f" ({e})")
                                  + f"; use longer lengths or leave {task} out of --tasks") from None
            for e in batch:
                e["length"], e["n_tokens"] = length, e["n_tokens"] + extra
            out += batch
    return out


def stream_call_tokens(model: torch.nn.Module) -> Optional[int]:
    """Titans models read long prompts in calls of this many tokens, carrying the memory state from
    one call to the next (:func:`greedy_generate`); None for other models. MAC: ``model.max_seq_len``
    rounded down to whole segments (the carried state is then exact). MAG / MAL: ``max_seq_len`` less
    the attention window, so the call that goes on generating holds more than a window of the prompt
    and every new token's sliding window sees the tokens before it (their window restarts at a call;
    with calls of ``max_seq_len`` a 2x-context prompt's question and answer fell after the last
    boundary in a call of a few tokens). LMM: ``max_seq_len``."""
    from memtrain.model.titans.arch import TitansLM

    if not isinstance(model, TitansLM):
        return None
    n, t = model.cfg.max_seq_len, model.titans
    if t.variant == "mac" and n >= t.segment_len:
        n = n // t.segment_len * t.segment_len
    elif t.variant in ("mag", "mal") and n > t.window:
        n -= t.window
    return n


def reading_plan(model: torch.nn.Module, recipe: Recipe) -> tuple[Optional[int], Optional[int]]:
    """``(stream_tokens, max_context)`` for :func:`greedy_generate`: a Titans model reads long prompts in calls
    of :func:`stream_call_tokens` with its memory carried, at most ``model.max_seq_len`` at a time; any other
    model has no stream and its :func:`model_context`."""
    stream = stream_call_tokens(model)
    return stream, recipe.model.max_seq_len if stream is not None else model_context(model, recipe)


def model_context(model: torch.nn.Module, recipe: Recipe) -> Optional[int]:
    """The longest input the model takes: a Hugging Face model's ``max_position_embeddings`` (its
    pretrained context), None (no limit) for a decoder with sliding-window attention (its RoPE offsets
    never exceed the window, so any length is read as in training), else ``model.max_seq_len``."""
    if recipe.model.type == "decoder" and recipe.model.attention_window is not None:
        return None
    if recipe.model.type == "hf":
        for module in model.modules():
            config = getattr(module, "config", None)
            if config is not None and not isinstance(config, type(recipe.model)):
                get = getattr(config, "get_text_config", None)
                config = get() if callable(get) else config
                n = getattr(config, "max_position_embeddings", None)
                if isinstance(n, int) and n > 0:
                    return n
    return recipe.model.max_seq_len


@contextlib.contextmanager
def fresh_memory_per_forward(model: torch.nn.Module) -> Iterator[None]:
    """MemoryLlama blocks (:mod:`memtrain.model.titans.memory_llama`) in ``per_forward`` mode while generating
    without a KV cache: every forward re-reads its sample from the start, so it must start from the
    initial memory M_0 (``auto`` does the same for cache-less forwards; ``stream`` would carry the
    previous call's state). The blocks' modes are restored afterwards. No-op for other models."""
    from memtrain.model.titans.memory_llama import GatedMemoryBlock

    blocks = [m for m in model.modules() if isinstance(m, GatedMemoryBlock)]
    modes = [b.mode for b in blocks]
    for b in blocks:
        b.mode = "per_forward"
        b.reset_memory()
    try:
        yield
    finally:
        for b, mode in zip(blocks, modes):
            b.mode = mode
            b.reset_memory()


@torch.no_grad()
def greedy_generate(model: torch.nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int, eot_id: int,
                    max_context: Optional[int], *, stream_tokens: Optional[int] = None,
                    batch_size: int = TASK_BATCH_SIZE, memory_fn: Callable[[int], Any] = lambda n: None,
                    device: torch.device | str = "cpu", pad_id: Optional[int] = None, vocab_size: Optional[int] = None,
                    logits_budget: int = LOGITS_BUDGET, token_limit: Optional[int] = None
                    ) -> tuple[list[list[int]], list[bool]]:
    """Greedy decoding without a KV cache: each new token re-runs the model on the whole prefix (or, for
    a streamed model, on the part after its carried memory). Stops at ``eot_id`` (not returned) or after
    ``max_new_tokens``. Returns (new tokens per prompt, whether the prompt was truncated).

    - **window** (``stream_tokens`` None: decoders, Hugging Face models): a prompt longer than
      ``max_context - max_new_tokens + 1`` tokens keeps its last that many (left truncation, flagged),
      so every forward fits ``max_context`` (None: no limit, every prompt is read whole). Prompts are
      sorted by length and batched right-padded (``pad_id``, default ``eot_id``; the models are causal,
      so padding after a row never changes its logits); each row's next token is read at its own last
      position. A model whose logits padding changes (sequence routing:
      :func:`~memtrain.eval.common.padding_changes_logits`) batches prompts of equal length only, so no row
      is padded. ``memory_fn(batch)`` is the ``memory`` argument (e.g. the generic memory of a
      hierarchical-memory model).
    - **stream** (``stream_tokens`` = C: Titans): every sample starts from a fresh memory; while the
      unread part of a sequence exceeds ``max_context`` its first C tokens are run and the memory state
      the model returns (``output.memory``) is carried into the next call, so nothing is truncated.
      For MAC with C a multiple of the segment length the result equals one forward over the whole
      sequence, and so for LMM; MAG / MAL sliding windows restart at each call (the last call keeps more
      than a window, :func:`stream_call_tokens`), and since each block's memory reads the block's input,
      which the restarted attention of the blocks below shaped, their memory states from the second block
      on differ from one long forward's too. Prompts of equal length are batched (no padding).

    The batch is capped so that one forward's fp32 logits stay within ``logits_budget`` bytes
    (``vocab_size`` known). ``token_limit`` (the tokenizer's vocabulary size): ids from it on are never chosen. A
    model's vocabulary may be padded past its tokenizer's (a multiple of 64 is faster), and an id the tokenizer
    does not have stopped its decoding with an IndexError."""
    n = len(prompts)
    device = torch.device(device)
    pad = eot_id if pad_id is None else pad_id
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    if stream_tokens is None and max_context is None:
        seqs = [list(map(int, p)) for p in prompts]
        truncated = [False] * n
        span = lambda length: length + max_new_tokens - 1  # noqa: E731
    elif stream_tokens is None:
        budget = max_context - max_new_tokens + 1
        if budget < 1:
            raise ValueError(f"max_new_tokens {max_new_tokens} leaves no room for a prompt in {max_context} tokens")
        seqs = [list(map(int, p))[-budget:] for p in prompts]
        truncated = [len(p) > budget for p in prompts]
        span = lambda length: length + max_new_tokens - 1  # noqa: E731 - the longest forward of a row
    else:
        if max_context is None or not 1 <= stream_tokens <= max_context:
            raise ValueError(f"stream_tokens must lie in [1, {max_context}], got {stream_tokens}")
        seqs = [list(map(int, p)) for p in prompts]
        truncated = [False] * n
        span = lambda length: min(max_context, length + max_new_tokens - 1)  # noqa: E731
    if any(len(s) == 0 for s in seqs):
        raise ValueError("empty prompt")
    lengths = [len(s) for s in seqs]

    def max_rows(length: int) -> int:
        if not vocab_size:
            return batch_size
        return max(1, logits_budget // (4 * vocab_size * max(1, span(length))))

    order = sorted(range(n), key=lambda i: (-lengths[i], i))
    outputs: list[list[int]] = [[] for _ in range(n)]
    same_length = stream_tokens is not None or padding_changes_logits(model)  # no padding in a batch
    for rows in length_batches(order, lengths, batch_size, same_length, max_rows):
        if stream_tokens is None:
            _generate_window(model, rows, seqs, outputs, max_new_tokens, eot_id, pad, memory_fn, device, token_limit)
        else:
            _generate_stream(model, rows, seqs, outputs, max_new_tokens, eot_id, max_context, stream_tokens,
                             device, token_limit)
    return outputs, truncated


def _generate_window(model, rows, seqs, outputs, max_new_tokens, eot_id, pad, memory_fn, device,
                     token_limit: Optional[int] = None) -> None:
    cur = {i: list(seqs[i]) for i in rows}
    active = list(rows)
    for _ in range(max_new_tokens):
        if not active:
            break
        tokens, lens = right_padded([cur[i] for i in active], pad)
        logits = model(tokens.to(device), doc_ids=None, memory=memory_fn(len(active))).logits
        last = logits[torch.arange(len(active), device=logits.device), (lens - 1).to(logits.device)]
        nxt = last[:, :token_limit].argmax(-1).tolist()
        still = []
        for i, t in zip(active, nxt):
            if t == eot_id:
                continue
            outputs[i].append(int(t))
            cur[i].append(int(t))
            still.append(i)
        active = still


def _generate_stream(model, rows, seqs, outputs, max_new_tokens, eot_id, max_context, call_tokens, device,
                     token_limit: Optional[int] = None) -> None:
    seq = torch.tensor([seqs[i] for i in rows], dtype=torch.long, device=device)  # equal lengths
    state, done = None, [False] * len(rows)  # None: a fresh memory for every sample
    start = 0  # tokens already in the carried state
    for _ in range(max_new_tokens):
        while seq.shape[1] - start > max_context:
            state = model(seq[:, start:start + call_tokens], doc_ids=None, memory=state).memory
            start += call_tokens
        nxt = model(seq[:, start:], doc_ids=None, memory=state).logits[:, -1, :token_limit].argmax(-1)
        for r, t in enumerate(nxt.tolist()):
            if not done[r]:
                if t == eot_id:
                    done[r] = True
                else:
                    outputs[rows[r]].append(int(t))
        if all(done):
            break
        seq = torch.cat([seq, nxt[:, None].to(seq.dtype)], dim=1)


def _cell(hits: Sequence[bool], cut: Sequence[bool]) -> dict[str, Any]:
    return accuracy_cell(hits, truncated=int(sum(cut)))


def run_long_context(model: torch.nn.Module, tokenizer: Any, examples: Sequence[dict], max_new_tokens: int,
                     max_context: Optional[int], *, stream_tokens: Optional[int] = None,
                     batch_size: int = TASK_BATCH_SIZE, memory_fn: Callable[[int], Any] = lambda n: None, device: torch.device | str = "cpu",
                     vocab_size: Optional[int] = None, encoder: Optional[PromptEncoder] = None) -> dict[str, Any]:
    """Tokenize each example's prompt (:func:`memtrain.data.tasks.format_prompt`), generate
    greedily (:func:`greedy_generate`; MemoryLlama blocks start every forward from M_0), decode and score
    (:func:`memtrain.data.tasks.score`, whole-word answer match). Returns accuracy with
    counts and truncated prompts overall, per task, per length, per task and length, per needle depth
    (S-NIAH examples only), the BABILong examples by the benchmark's own stricter rule (``babilong``:
    :func:`memtrain.data.tasks.babilong_correct`), and every example's prediction."""
    from memtrain.data.tasks import BABILONG_TASKS, NIAH_TASKS, babilong_correct, format_prompt, is_correct

    encoder = encoder or PromptEncoder(tokenizer)
    prompts = [encoder.encode(format_prompt(e)) for e in examples]
    eot = int(tokenizer.eot_id)
    with fresh_memory_per_forward(model):
        generated, truncated = greedy_generate(model, prompts, max_new_tokens, eot, max_context,
                                               stream_tokens=stream_tokens, batch_size=batch_size,
                                               memory_fn=memory_fn, device=device, vocab_size=vocab_size,
                                               token_limit=getattr(tokenizer, "vocab_size", None))
    predictions = [tokenizer.decode(g) if g else "" for g in generated]
    hits = [is_correct(p, e["answer"]) for p, e in zip(predictions, examples)]
    strict = [babilong_correct(p, e) for p, e in zip(predictions, examples)]

    def cells(key: Callable[[dict], Any], where: Callable[[dict], bool] = lambda e: True,
              correct: Sequence[bool] = hits) -> dict[str, Any]:
        groups: dict[str, tuple[list, list]] = {}
        for h, c, e in zip(correct, truncated, examples):
            if where(e):
                g = groups.setdefault(str(key(e)), ([], []))
                g[0].append(h)
                g[1].append(c)
        return {k: _cell(*v) for k, v in groups.items()}

    tasks = list(dict.fromkeys(e["task"] for e in examples))
    qa = [t for t in tasks if t in BABILONG_TASKS]
    babilong = None
    if qa:
        is_qa = lambda e: e["task"] in BABILONG_TASKS  # noqa: E731
        babilong = {"all": cells(lambda e: "all", is_qa, strict)["all"],
                    "by_task": cells(lambda e: e["task"], is_qa, strict),
                    "by_task_length": {t: cells(lambda e: e["length"], lambda e, t=t: e["task"] == t, strict)
                                       for t in qa}}
    return {
        "all": _cell(hits, truncated),
        "by_task": cells(lambda e: e["task"]),
        "by_length": cells(lambda e: e["length"]),
        "by_task_length": {t: cells(lambda e: e["length"], lambda e, t=t: e["task"] == t) for t in tasks},
        # a needle's depth; a BABILong example's "depth" (its earliest supporting fact) is not bucketed with them
        "by_depth": cells(lambda e: e["depth"], lambda e: e["task"] in NIAH_TASKS),
        "babilong": babilong,
        "truncated": int(sum(truncated)),
        "examples": [{"task": e["task"], "length": e["length"], "depth": e["depth"], "prompt_tokens": len(p),
                      "truncated": c, "answer": e["answer"], "prediction": pred[:200], "correct": h,
                      **({"correct_babilong": s} if e["task"] in BABILONG_TASKS else {})}
                     for e, p, c, pred, h, s in zip(examples, prompts, truncated, predictions, hits, strict)],
    }



def long_context(model: torch.nn.Module, bank: Any, recipe: Recipe, tokenizer: Any, encoder: PromptEncoder,
                 examples: Sequence[dict], tasks: Sequence[str], lengths: Sequence[int], samples: int,
                 max_new_tokens: int, device: torch.device, batch_size: int = TASK_BATCH_SIZE) -> dict[str, Any]:
    """The ``long_context`` entry of the report: the settings and :func:`run_long_context`'s results.
    Titans models stream (:func:`stream_call_tokens`); others see a window of :func:`model_context`
    tokens; a hierarchical-memory model uses its generic memory (no retrieval for these prompts)."""
    t0 = time.perf_counter()
    stream, max_context = reading_plan(model, recipe)
    memory_fn: Callable[[int], Any] = lambda n: None  # noqa: E731
    if bank is not None:
        memory_fn = lambda n: batch_memory(bank, "generic", n, None, device)  # noqa: E731
        memory = "generic (the hierarchical memory's generic blocks; nothing is retrieved)"
    elif stream is not None:
        memory = "fresh per sample (the Titans memory state carried across calls within a sample)"
    elif recipe.memory.type == "memory_llama":
        memory = "fresh per sample (every forward starts from M_0)"
    else:
        memory = "none"
    vocab = getattr(model, "vocab_size", None) or recipe.model.vocab_size
    results = run_long_context(model, tokenizer, examples, max_new_tokens, max_context, stream_tokens=stream,
                               batch_size=batch_size, memory_fn=memory_fn, device=device, vocab_size=vocab,
                               encoder=encoder)
    from memtrain.data.tasks import NIAH_TASKS

    return {
        "tasks": list(tasks), "lengths": list(lengths), "samples": samples, "seed": TASK_SEED,
        "niah_depths": niah_depths(samples) if any(t in NIAH_TASKS for t in tasks) else [],
        "max_new_tokens": max_new_tokens, "length_unit": "tokens", "bos": bool(encoder.prefix),
        "context": {"mode": "stream" if stream is not None else "window" if max_context is not None else "whole",
                    "max_context": max_context, "call_tokens": stream,
                    "prompt_budget": None if stream is not None or max_context is None
                    else max_context - max_new_tokens + 1},
        "memory": memory,
        **results,
        "seconds": round(time.perf_counter() - t0, 3),
    }



def long_context_lines(lc: dict[str, Any]) -> list[str]:
    """The long-context part of :func:`format_table`: accuracy (%) per task and length, per task, per
    length and overall, then how the prompts were fed."""
    lengths = [str(n) for n in lc["lengths"]]
    width = max(len("task"), *(len(t) for t in lc["tasks"]))

    def pct(cell: Optional[dict]) -> str:
        return f"{100 * cell['accuracy']:7.1f}%" if cell and cell.get("accuracy") is not None else f"{'-':>8}"

    lines = [f"long-context tasks (greedy, <= {lc['max_new_tokens']} new tokens, answer as a whole word); "
             f"accuracy by prompt length in tokens:",
             f"{'task':<{width}}  " + "  ".join(f"{n:>8}" for n in lengths) + f"  {'all':>8}"]
    for task in lc["tasks"]:
        row = lc["by_task_length"].get(task, {})
        lines.append(f"{task:<{width}}  " + "  ".join(pct(row.get(n)) for n in lengths)
                     + f"  {pct(lc['by_task'].get(task))}")
    lines.append(f"{'all':<{width}}  " + "  ".join(pct(lc["by_length"].get(n)) for n in lengths)
                 + f"  {pct(lc['all'])}")
    ctx = lc["context"]
    if ctx["mode"] == "stream":
        how = (f"read in calls of {ctx['call_tokens']} tokens with the memory carried between them "
               f"(nothing truncated)")
    elif ctx["mode"] == "whole":
        how = "read whole (sliding-window attention: no context limit)"
    else:
        how = (f"{lc['truncated']} left-truncated to {ctx['prompt_budget']} tokens to fit the model's "
               f"{ctx['max_context']}-token context")
    lines.append(f"prompts: {lc['all']['count']} ({lc['samples']} per task and length), {how}; memory: "
                 f"{lc['memory'].split(' (')[0]}; predictions in the JSON")
    babilong = lc.get("babilong")
    if babilong:
        lines.append("BABILong's own scorer (the first sentence names the answer and no other place, person or "
                     "object): " + ", ".join(f"{t} {pct(c).strip()}" for t, c in babilong["by_task"].items())
                     + f"; all {pct(babilong['all']).strip()}")
    return lines


__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "DEFAULT_TASKS",
    "DEFAULT_TASK_LENGTHS",
    "DEFAULT_TASK_SAMPLES",
    "LOGITS_BUDGET",
    "NO_CONTEXT_LIMIT",
    "PromptEncoder",
    "TASK_BATCH_SIZE",
    "TASK_GROUPS",
    "TASK_SEED",
    "check_long_context",
    "fresh_memory_per_forward",
    "greedy_generate",
    "long_context",
    "long_context_by_default",
    "long_context_lines",
    "model_context",
    "niah_depths",
    "parse_lengths",
    "parse_tasks",
    "reading_plan",
    "run_long_context",
    "stream_call_tokens",
    "task_examples",
]
