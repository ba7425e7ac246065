"""`memtrain eval` long-context tasks (memtrain.eval.longctx): greedy generation and scoring on
stub models whose outputs are known (stop at end-of-text, left truncation counted, streamed memory
state), Titans streaming equal to one long forward, MemoryLlama's memory reset per sample, and an
end-to-end run (prepare the built-in corpus, train a tiny Titans MAC model, `memtrain eval`)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from memtrain.config import ModelConfig, RecipeError, TitansConfig
from memtrain.eval.common import PromptEncoder
from memtrain.eval.longctx import (
    check_long_context, fresh_memory_per_forward, greedy_generate, niah_depths, parse_lengths, parse_tasks,
    run_long_context, stream_call_tokens, task_examples,
)
from memtrain.data.tasks import format_prompt, is_correct
from memtrain.model.anchor import ModelOutput
from memtrain.model.titans.arch import TitansOutput

from tiny_hf import make_tiny_llama  # tests/tiny_hf.py

REPO = Path(__file__).resolve().parents[1]
V, EOT = 16, 0


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def train_in_subprocess(path: Path, **env_extra: str) -> None:
    """``memtrain train`` of the recipe at ``path`` on one thread in a child process (training starts a
    gloo process group: keep it out of the test process)."""
    code = ("import sys, torch\ntorch.set_num_threads(1)\ntorch.set_num_threads = lambda n: None\n"
            "from memtrain.config import load_recipe\nfrom memtrain.launcher.train import train\n"
            "train(load_recipe(sys.argv[1]))\n")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "LOCAL_", "WORLD_SIZE", "MASTER_", "SLURM_", "TORCHELASTIC"))}
    out = subprocess.run([sys.executable, "-c", code, str(path)], cwd=REPO, capture_output=True, text=True,
                         timeout=600, env={**env, "OMP_NUM_THREADS": "1", **env_extra})
    assert out.returncode == 0, out.stderr[-5000:]


# --------------------------------------------------------------------------------------------------
# Stub models: the next token is (sum of every token so far) mod 16; 0 is end-of-text


class SumLM(nn.Module):
    """Causal: the logits at position t pick ``(tokens[0..t].sum() + carried) % V``. ``memory``: None
    (nothing carried) or a previous output's ``memory`` (the running sum per row). Records every call."""

    def __init__(self, stateful: bool = False):
        super().__init__()
        self.stateful = stateful
        self.calls: list[tuple[list[list[int]], object]] = []

    def forward(self, input_ids, doc_ids=None, memory=None):
        self.calls.append((input_ids.tolist(), None if memory is None else memory.clone()))
        carried = torch.zeros(input_ids.shape[0], dtype=torch.long) if memory is None else memory
        total = input_ids.cumsum(1) + carried[:, None]
        logits = torch.nn.functional.one_hot(total % V, V).float() * 5
        if self.stateful:
            return TitansOutput(logits=logits, memory=total[:, -1])
        return ModelOutput(logits=logits)


def sums_reference(prompt: list[int], max_new: int) -> list[int]:
    out, total = [], sum(prompt)
    for _ in range(max_new):
        t = total % V
        if t == EOT:
            break
        out.append(t)
        total += t
    return out


def test_window_generation_exact_stop_and_truncation():
    model = SumLM()
    prompts = [[3, 4],              # 7, 14, 12 (28), 8 (40), then 48 = 0 mod 16: end-of-text
               [8, 8],              # 16: end-of-text at once
               [1],                 # 1, 2, 4, 8, then 16: end-of-text
               [5, 1, 1, 1, 1],     # 5 tokens > budget 4: keeps [1, 1, 1, 1] -> 4, 8, then 16
               [2, 3]]              # 5, 10, 4 (20), 8 (24), then 32: end-of-text
    out, cut = greedy_generate(model, prompts, max_new_tokens=5, eot_id=EOT, max_context=8, batch_size=2, pad_id=9)
    assert out == [[7, 14, 12, 8], [], [1, 2, 4, 8], [4, 8], [5, 10, 4, 8]]
    assert cut == [False, False, False, True, False]
    assert out[3] != sums_reference(prompts[3], 5)  # the untruncated prompt would continue differently
    # Every forward fits the context (budget 8 - 5 + 1 = 4 prompt tokens + 4 generated), batches are
    # right-padded with pad_id, rows that stopped leave the batch, and nothing is carried.
    assert all(len(row) <= 8 for ids, _ in model.calls for row in ids)
    assert all(memory is None for _, memory in model.calls)
    assert any(9 in row for ids, _ in model.calls for row in ids)
    # Batching does not change the result.
    for batch_size in (1, 3, 8):
        assert greedy_generate(SumLM(), prompts, 5, EOT, 8, batch_size=batch_size)[0] == out
    # max_new_tokens caps the output; no room for a prompt is an error.
    assert greedy_generate(SumLM(), [[1]], 2, EOT, 8)[0] == [[1, 2]]
    with pytest.raises(ValueError, match="max_new_tokens 9 leaves no room for a prompt in 8 tokens"):
        greedy_generate(SumLM(), [[1]], 9, EOT, 8)


def test_ids_the_tokenizer_lacks_are_never_generated():
    """A model's vocabulary may be padded past its tokenizer's (a multiple of 64): an id from the tokenizer's size on
    is never chosen, in either mode (before, the tokenizer's decode raised IndexError: piece id is out of range)."""
    prompts = [[3, 4], [1], [2, 3]]
    free = greedy_generate(SumLM(), prompts, 5, EOT, 8)[0]
    assert any(t >= 8 for row in free for t in row)  # unlimited, this model does produce ids from 8 on
    for stream in (None, 3):
        model = SumLM(stateful=stream is not None)
        out, _ = greedy_generate(model, prompts, 5, EOT, 8 if stream is None else 4, stream_tokens=stream,
                                 token_limit=8)
        assert all(t < 8 for row in out for t in row) and any(out), (stream, out)


def test_logits_budget_caps_the_batch():
    model = SumLM()
    prompts = [[1, 2, 3]] * 5
    out, _ = greedy_generate(model, prompts, 1, EOT, 8, batch_size=8, vocab_size=V, logits_budget=4 * V * 3 * 2)
    assert out == [[6]] * 5 and [len(ids) for ids, _ in model.calls] == [2, 2, 1]


def test_stream_generation_carries_state_and_never_truncates():
    """Prompts longer than the context are read in calls of ``stream_tokens`` with the state carried:
    the result equals the untruncated one; every sample starts from a fresh state (memory None)."""
    prompts = [[5, 1, 1, 1, 1, 2, 3], [3, 4], [1, 1, 1, 1, 1, 1, 1], [2, 2, 2, 2, 2, 2, 3]]
    model = SumLM(stateful=True)
    out, cut = greedy_generate(model, prompts, 5, EOT, max_context=4, stream_tokens=3, batch_size=4)
    assert out == [sums_reference(p, 5) for p in prompts] and cut == [False] * 4
    assert all(len(row) <= 4 for ids, _ in model.calls for row in ids)
    # Equal lengths are batched: the three 7-token prompts share calls, [3, 4] runs alone.
    assert sorted({len(ids) for ids, _ in model.calls}) == [1, 3]
    # A call from a fresh memory (None) reads its samples from their first token; the others continue.
    full = [p + o for p, o in zip(prompts, out)]
    for ids, memory in model.calls:
        from_start = all(any(f[:len(row)] == row for f in full) for row in ids)
        assert from_start or memory is not None
    assert any(memory is not None for _, memory in model.calls)
    assert greedy_generate(SumLM(stateful=True), prompts, 5, EOT, 4, stream_tokens=3, batch_size=1)[0] == out
    with pytest.raises(ValueError, match=r"stream_tokens must lie in \[1, 4\], got 5"):
        greedy_generate(SumLM(stateful=True), prompts, 5, EOT, 4, stream_tokens=5)


class TableTokenizer:
    """Prompt text -> the token ids given for it; decode writes the ids as numbers."""

    eot_id = EOT

    def __init__(self, table: dict[str, list[int]]):
        self.table = table

    def encode(self, text):
        return list(self.table[text])

    def encode_batch(self, texts):
        return [self.encode(t) for t in texts]

    def decode(self, ids):
        return " ".join(str(i) for i in ids)


def test_run_long_context_scores_and_counts():
    def ex(task, length, depth, context, answer):
        return {"task": task, "context": context, "question": "Q?", "answer": answer, "length": length,
                "depth": depth, "n_tokens": 0}

    examples = [ex("passkey", 512, 0.0, "a", "14"),      # [3, 4] -> "7 14 12 8": correct
                ex("passkey", 512, 1.0, "b", "1"),       # [1] -> "1 2 4 8": correct (a whole word)
                ex("passkey", 1024, 0.5, "c", "4"),      # truncated to [1, 1, 1, 1] -> "4 8": correct
                ex("qa1", 512, 0.25, "d", "12"),         # [8, 8] -> "": incorrect
                ex("qa1", 1024, 0.25, "e", "10")]        # [2, 3] -> "5 10 4 8": correct
    ids = {"a": [3, 4], "b": [1], "c": [5, 1, 1, 1, 1], "d": [8, 8], "e": [2, 3]}
    tok = TableTokenizer({format_prompt(e): ids[e["context"]] for e in examples})
    res = run_long_context(SumLM(), tok, examples, max_new_tokens=5, max_context=8, batch_size=2)
    assert res["all"] == {"accuracy": 0.8, "correct": 4, "count": 5, "truncated": 1}
    assert res["by_task"]["passkey"] == {"accuracy": 1.0, "correct": 3, "count": 3, "truncated": 1}
    assert res["by_task"]["qa1"]["accuracy"] == 0.5
    assert res["by_length"]["512"] == {"accuracy": 2 / 3, "correct": 2, "count": 3, "truncated": 0}
    assert res["by_task_length"]["passkey"]["1024"] == {"accuracy": 1.0, "correct": 1, "count": 1, "truncated": 1}
    assert res["by_task_length"]["qa1"] == {"512": {"accuracy": 0.0, "correct": 0, "count": 1, "truncated": 0},
                                            "1024": {"accuracy": 1.0, "correct": 1, "count": 1, "truncated": 0}}
    # needle depths only: the qa1 examples' "depth" (earliest supporting fact) is not bucketed with them
    assert res["by_depth"] == {d: {"accuracy": 1.0, "correct": 1, "count": 1, "truncated": int(d == "0.5")}
                               for d in ("0.0", "1.0", "0.5")}
    # BABILong's own scorer: "10" names no place, so neither qa1 prediction counts there
    assert res["babilong"]["all"] == {"accuracy": 0.0, "correct": 0, "count": 2, "truncated": 0}
    assert list(res["babilong"]["by_task"]) == ["qa1"] and set(res["babilong"]["by_task_length"]["qa1"]) == {"512",
                                                                                                        "1024"}
    assert [e.get("correct_babilong") for e in res["examples"]] == [None, None, None, False, False]
    assert [e["prediction"] for e in res["examples"]] == ["7 14 12 8", "1 2 4 8", "4 8", "", "5 10 4 8"]
    assert [e["prompt_tokens"] for e in res["examples"]] == [2, 1, 5, 2, 2]
    assert res["truncated"] == 1


# --------------------------------------------------------------------------------------------------
# Settings


def test_parse_settings():
    assert parse_tasks("niah,babilong") == ["passkey", "number", "word", "qa1", "qa2", "qa3", "qa4", "qa5"]
    assert parse_tasks("qa2, passkey,qa2") == ["qa2", "passkey"]
    assert parse_tasks("none") == [] and parse_tasks("") == []
    with pytest.raises(RecipeError, match="unknown long-context task 'bogus'"):
        parse_tasks("niah,bogus")
    assert parse_lengths("512, 1024") == [512, 1024] and parse_lengths("2K,16k") == [2048, 16384]
    assert parse_lengths(None) == [512, 1024]
    for bad in ("abc", "32", "", "1.5k"):
        with pytest.raises(RecipeError, match="--lengths"):
            parse_lengths(bad)
    assert niah_depths(1) == [0.5] and niah_depths(5) == [0.0, 0.25, 0.5, 0.75, 1.0]

    from memtrain.config import recipe_from_dict

    titans = recipe_from_dict({"model": {"type": "titans"}})
    decoder = recipe_from_dict({})
    assert check_long_context(titans, None, None, None, None) == (parse_tasks("niah,babilong"), [512, 1024], 5, 16)
    assert check_long_context(decoder, None, None, None, None)[0] == []
    assert check_long_context(decoder, "qa1", "256", 2, 4) == (["qa1"], [256], 2, 4)
    with pytest.raises(RecipeError, match="--lengths set, but no long-context task runs"):
        check_long_context(decoder, None, "256", None, None)
    with pytest.raises(RecipeError, match="--samples must be >= 1"):
        check_long_context(titans, None, None, 0, None)


class WordTokenizer:
    """Whitespace words -> ids (unknown words get new ids), decode joins them back."""

    eot_id = 0

    def __init__(self):
        self.ids: dict[str, int] = {}
        self.words = ["<eot>"]

    def encode(self, text):
        out = []
        for w in text.split():
            if w not in self.ids:
                self.ids[w] = len(self.words)
                self.words.append(w)
            out.append(self.ids[w])
        return out

    def decode(self, ids):
        return " ".join(self.words[i] for i in ids)


def test_task_examples_fit_their_lengths():
    enc = PromptEncoder(WordTokenizer())
    examples = task_examples(["passkey", "word", "qa2"], [300, 600], 3, enc)
    assert [(e["task"], e["length"]) for e in examples] == [(t, n) for t in ("passkey", "word", "qa2")
                                                           for n in (300, 600) for _ in range(3)]
    for e in examples:
        n = len(enc.encode(format_prompt(e)))
        assert n == e["n_tokens"] and 0.9 * e["length"] <= n <= e["length"]
    assert [e["depth"] for e in examples if e["task"] == "word"] == [0.0, 0.5, 1.0] * 2
    assert task_examples(["qa2"], [300], 3, PromptEncoder(WordTokenizer())) == examples[12:15]  # deterministic
    with pytest.raises(RecipeError, match="too short for qa3"):
        task_examples(["qa3"], [64], 1, enc)


# --------------------------------------------------------------------------------------------------
# Titans: streaming equals one long forward


def tiny_titans(max_seq_len: int, variant: str = "mac") -> ModelConfig:
    t = TitansConfig(variant=variant, memory_heads=2, memory_chunk_size=4, segment_len=8, window=6,
                     persistent_tokens=2, memory_max_lr=0.1, memory_init_lr=0.02)
    return ModelConfig(type="titans", vocab_size=40, d_model=32, n_layers=2, n_heads=4, ffn_dim=64,
                       max_seq_len=max_seq_len, attention="sdpa", titans=t)


def test_babilong_scorer_takes_the_first_sentence_and_one_label():
    """BABILong's scoring rule (the benchmark's scorer, which the Titans paper follows), stricter than the thesis
    protocol's "contains the answer": the first sentence must name the answer and no other of the task's labels
    (labels the question names aside), as whole words."""
    from memtrain.data.tasks import babilong_correct

    qa1 = {"task": "qa1", "question": "Where is Mary?", "answer": "kitchen"}
    for prediction, strict in (("kitchen", True), (" The kitchen. Then the garden.", True),
                               ("kitchen garden hallway office", False),  # a list of places: only the thesis counts it
                               ("the garden. Mary went to the kitchen", False), ("Kitchen\nQuestion: garden", True),
                               ("kitchens", False), ("", False)):
        assert babilong_correct(prediction, qa1) is strict, prediction
        assert is_correct(prediction, "kitchen") is (prediction not in ("kitchens", ""))
    qa4 = {"task": "qa4", "question": "What is east of the hallway?", "answer": "office"}
    assert babilong_correct("the office is east of the hallway", qa4)  # the question's own label aside
    assert not babilong_correct("the office or the garden", qa4)
    qa5 = {"task": "qa5", "question": "What did Fred give to Mary?", "answer": "hat"}
    assert babilong_correct("that was the hat", qa5) and not babilong_correct("that apple", qa5)  # whole words
    assert babilong_correct("4123", {"task": "passkey", "question": "?", "answer": "4123"})  # S-NIAH: is_correct


def test_mag_and_mal_generate_with_a_window_of_the_prompt_in_attention():
    """MAG / MAL stream in calls of max_seq_len less the window (their attention window restarts at a call), so
    the call that picks each new token holds more than a window of the tokens before it. With calls of
    max_seq_len (until 2026-11-30) a prompt of twice the context left 1 token in the call that generated."""
    from memtrain.model import build

    for variant, call in (("mag", 14), ("mal", 14), ("lmm", 20), ("mac", 16)):
        torch.manual_seed(0)
        model = build(tiny_titans(20, variant)).eval()
        assert stream_call_tokens(model) == call, variant
    calls = []
    forward = model.forward

    def recording(input_ids, doc_ids=None, memory=None):
        out = forward(input_ids, doc_ids=doc_ids, memory=memory)
        calls.append((input_ids.shape[1], memory, out.memory))
        return out

    for variant in ("mag", "mal"):
        torch.manual_seed(0)
        model = build(tiny_titans(20, variant)).eval()
        forward, calls[:] = model.forward, []
        model.forward = recording
        prompt = torch.randint(1, 40, (40,), generator=torch.Generator().manual_seed(2)).tolist()
        out, _ = greedy_generate(model, [prompt], 6, -1, 20, stream_tokens=stream_call_tokens(model))
        picking = [n for (n, _, carried), nxt in zip(calls, calls[1:] + [(0, None, None)]) if nxt[1] is not carried]
        assert len(picking) == 6 and min(picking) > 6, (variant, picking)  # window 6


def test_titans_answer_logprob_reads_the_whole_prompt_with_the_memory_carried():
    """memtrain generate --answer on a Titans model scores the answer after the whole prompt, read in calls with
    the memory carried as generation reads it: equal to one long forward for MAC. Until 2026-11-30 it kept the
    prompt's last max_seq_len tokens (one forward), so the start of a long prompt did not count."""
    from memtrain.launcher.generate import answer_logprob
    from memtrain.model import build

    torch.manual_seed(0)
    short = build(tiny_titans(20)).double().eval()
    long = build(tiny_titans(512)).double().eval()
    long.load_state_dict(short.state_dict())
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, 40, (70,), generator=g).tolist()
    cpu = torch.device("cpu")
    for start in (60, 49, 33):  # the answer after, inside and across call boundaries (calls of 16)
        streamed = answer_logprob(short, tokens, start, 20, cpu, stream_tokens=stream_call_tokens(short))
        assert streamed == pytest.approx(answer_logprob(long, tokens, start, 512, cpu), abs=1e-9), start
    changed = [t % 39 + 1 for t in tokens[:10]] + tokens[10:]  # the first tokens, far outside the last window
    assert abs(answer_logprob(short, changed, 60, 20, cpu, stream_tokens=16)
               - answer_logprob(short, tokens, 60, 20, cpu, stream_tokens=16)) > 1e-6


def test_titans_stream_equals_one_long_forward():
    from memtrain.model import build

    torch.manual_seed(0)
    short = build(tiny_titans(20)).double().eval()       # calls of 16 tokens (two MAC segments)
    long = build(tiny_titans(512)).double().eval()
    long.load_state_dict(short.state_dict())
    assert stream_call_tokens(short) == 16 and stream_call_tokens(nn.Linear(1, 1)) is None
    g = torch.Generator().manual_seed(1)
    NEVER = -1  # no end-of-text: every prompt gets 6 tokens
    prompts = [torch.randint(1, 40, (n,), generator=g).tolist() for n in (70, 70, 45, 9)]
    streamed, cut = greedy_generate(short, prompts, 6, NEVER, 20, stream_tokens=stream_call_tokens(short))
    full, _ = greedy_generate(long, prompts, 6, NEVER, 512, pad_id=0)
    assert streamed == full and not any(cut) and all(len(o) == 6 for o in full)
    # The streamed logits equal the long forward's (state carried at segment boundaries).
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        state = short(ids[:, :16]).memory
        state = short(ids[:, 16:32], memory=state).memory
        tail = short(ids[:, 32:48], memory=state).logits
        ref = long(ids[:, :48]).logits[:, 32:]
    torch.testing.assert_close(tail, ref, rtol=0, atol=1e-9)
    # The same prompt alone, after another sample, or in a batch: the same tokens (fresh memory each).
    alone = greedy_generate(short, [prompts[1]], 6, NEVER, 20, stream_tokens=16)[0]
    assert alone == [streamed[1]]
    # A truncating window instead of streaming loses the start of the prompt.
    windowed, cut = greedy_generate(short, prompts, 6, NEVER, 20, pad_id=0)
    assert cut == [True, True, True, False] and windowed[3] == streamed[3]


# --------------------------------------------------------------------------------------------------
# MemoryLlama: memory reset per sample


class HFAdapter(nn.Module):
    """memtrain's call contract over a Hugging Face causal LM, without a KV cache (like HFMemoryLM)."""

    def __init__(self, hf):
        super().__init__()
        self.hf = hf
        self.last_logits: list[torch.Tensor] = []

    def forward(self, input_ids, doc_ids=None, memory=None):
        logits = self.hf(input_ids=input_ids, use_cache=False).logits
        self.last_logits.append(logits[:, -1].clone())
        return ModelOutput(logits=logits)


def test_memory_llama_generation_resets_memory_per_sample():
    import transformers

    from memtrain.model.titans.memory_llama import inject_memory, memory_blocks, set_memory_mode

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    inject_memory(hf, "elma", memory_kwargs=dict(heads=2, chunk_size=4))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # open the gates so that the memory changes the logits
        for b in memory_blocks(hf):
            b.w_h.weight.copy_(0.5 * torch.randn(b.w_h.weight.shape, generator=g))
            b.w_g.weight.copy_(0.1 * torch.randn(b.w_g.weight.shape, generator=g))
            b.w_g.bias.fill_(2.0)
    model = HFAdapter(hf)
    a = torch.randint(1, 96, (40,), generator=g).tolist()
    b = torch.randint(1, 96, (33,), generator=g).tolist()

    # Sensitivity: a memory carried across forwards ("stream") changes the repeated prompt's logits.
    set_memory_mode(hf, "stream")
    with torch.no_grad():
        first, second = model(torch.tensor([a])).logits, model(torch.tensor([a])).logits
    assert not torch.allclose(first, second, atol=1e-4)
    set_memory_mode(hf, "stream")

    def gen(prompts, batch_size=1):
        model.last_logits.clear()
        out, _ = greedy_generate(model, prompts, 5, eot_id=95, max_context=256, batch_size=batch_size)
        return out, list(model.last_logits)

    with fresh_memory_per_forward(model):
        (a1,), logits_a1 = gen([a])
        (b1,), _ = gen([b])
        (a2,), logits_a2 = gen([a])
        batched, _ = gen([b, a, a], batch_size=3)  # right-padded: b is shorter than a
    assert a1 == a2 and batched == [b1, a1, a1] and len(a1) == 5
    for x, y in zip(logits_a1, logits_a2):  # bit for bit: nothing of b (or of a) survived
        assert torch.equal(x, y)
    with torch.no_grad():  # and they are the logits of one forward from M_0
        set_memory_mode(hf, "per_forward")
        assert torch.equal(model(torch.tensor([a])).logits[:, -1], logits_a1[0])
        set_memory_mode(hf, "stream")
    assert all(blk.mode == "stream" for blk in memory_blocks(hf))  # restored after generation


# --------------------------------------------------------------------------------------------------
# End to end: prepare the built-in corpus, train a tiny Titans MAC model, `memtrain eval`

SEQ = 32


@pytest.fixture(scope="module")
def titans_run(tmp_path_factory):
    from memtrain.config import load_recipe
    from memtrain.data.prepare import prepare

    root = tmp_path_factory.mktemp("longctx")
    recipe = {
        "run": {"name": "longctx-mac", "seed": 3, "device": "cpu", "dir": str(root / "run")},
        "model": {"type": "titans", "vocab_size": 320, "d_model": 32, "n_layers": 2, "n_heads": 2, "ffn_dim": 64,
                  "max_seq_len": SEQ, "tie_embeddings": True,
                  "titans": {"variant": "mac", "memory_heads": 2, "memory_chunk_size": 8, "segment_len": 16,
                             "persistent_tokens": 2}},
        "data": {"dir": str(root / "data"), "sources": ["builtin"], "seq_len": SEQ, "val_fraction": 0.02,
                 "tokenizer": {"vocab_size": 320, "model_type": "bpe"}},
        "train": {"max_steps": 3, "global_batch_tokens": 4 * SEQ, "micro_batch_size": 4,
                  "optimizer": {"lr": 3.0e-3}, "schedule": {"kind": "cosine", "warmup": "1 steps", "min_lr": 3.0e-4},
                  "eval": {"every_steps": 3, "batches": 1}},
        "checkpoint": {"every_steps": 3, "keep_last": 1},
        "logging": {"every_steps": 3, "tensorboard": False},
    }
    path = root / "mac.yaml"
    path.write_text(yaml.safe_dump(recipe))
    prepare(load_recipe(path))
    train_in_subprocess(path)
    return root, path


def _eval(capsys, *args) -> tuple[int, str, str]:
    from memtrain.launcher.cli import main

    capsys.readouterr()
    code = main(["eval", *map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_eval_titans_long_context(titans_run, capsys):
    root, recipe = titans_run
    code, out, err = _eval(capsys, recipe, "--tasks", "passkey,qa1", "--lengths", "256,384", "--samples", "2",
                           "--max-new-tokens", "4", "--batches", "1")
    assert code == 0, err
    report = json.loads((root / "run" / "eval" / "global_step3.json").read_text())
    assert report["model"] == {"type": "titans", "variant": "mac"} and report["modes"] == ["none"]
    assert math.isfinite(report["perplexity"]["none"]["perplexity"])
    lc = report["long_context"]
    assert lc["tasks"] == ["passkey", "qa1"] and lc["lengths"] == [256, 384] and lc["samples"] == 2
    assert lc["context"] == {"mode": "stream", "max_context": SEQ, "call_tokens": SEQ, "prompt_budget": None}
    assert lc["all"]["count"] == 8 and lc["truncated"] == 0 and lc["niah_depths"] == [0.0, 1.0]
    assert 0.0 <= lc["all"]["accuracy"] <= 1.0
    for task in ("passkey", "qa1"):
        assert set(lc["by_task_length"][task]) == {"256", "384"}
        for cell in lc["by_task_length"][task].values():
            assert cell["count"] == 2 and 0.0 <= cell["accuracy"] <= 1.0
    assert [e["length"] for e in lc["examples"]] == [256, 256, 384, 384] * 2
    assert all(e["prompt_tokens"] <= e["length"] and e["prompt_tokens"] > SEQ for e in lc["examples"])
    lines = out.splitlines()
    i = next(k for k, line in enumerate(lines) if line.startswith("long-context tasks"))
    assert lines[i + 1].split() == ["task", "256", "384", "all"]
    assert [line.split()[0] for line in lines[i + 2:i + 5]] == ["passkey", "qa1", "all"]
    assert "8 (2 per task and length), read in calls of 32 tokens" in lines[i + 5]
    assert lines[i + 6].startswith("BABILong's own scorer (the first sentence names the answer and no other place, "
                                   "person or object): qa1 ")
    assert lc["babilong"]["all"]["count"] == 4 and set(lc["babilong"]["by_task"]) == {"qa1"}

    # Default for a Titans run: every task (here one sample at one length), next to val perplexity.
    target = root / "default.json"
    code, out, err = _eval(capsys, recipe, "--lengths", "640", "--samples", "1", "--max-new-tokens", "2",
                           "--batches", "0", "--out", target)
    assert code == 0, err
    lc = json.loads(target.read_text())["long_context"]
    assert lc["tasks"] == parse_tasks("niah,babilong") and lc["all"]["count"] == 8
    assert set(lc["by_task"]) == set(lc["tasks"]) and lc["by_length"]["640"]["count"] == 8

    # --tasks none: perplexity only.
    code, out, err = _eval(capsys, recipe, "--tasks", "none", "--out", target)
    assert code == 0, err
    assert json.loads(target.read_text())["long_context"] is None
    assert "long-context" not in out


def test_generate_streams_a_titans_prompt_longer_than_its_context(titans_run, tmp_path):
    """memtrain generate reads a Titans prompt longer than model.max_seq_len in calls with the memory carried, as
    eval's long-context tasks do: nothing is cut. Before, it kept the prompt's last tokens and said "truncated to
    fit the context", so a needle early in the prompt was gone."""
    from memtrain.config import load_recipe
    from memtrain.launcher.generate import generate

    _, path = titans_run
    prompt = " ".join(["The capital of the old country lies by the river."] * 30)
    lines: list[str] = []
    report = generate(load_recipe(path), [prompt], max_new_tokens=3, context_bank="off", echo=lines.append)
    (entry,) = report["prompts"]
    assert entry["tokens"] > SEQ and entry["truncated"] is False, (entry, lines)
    assert not any("truncated" in line for line in lines)


def test_eval_long_context_user_errors(titans_run, capsys):
    root, recipe = titans_run
    before = sorted(root.rglob("*"))
    cases = [(("--tasks", "bogus"), "unknown long-context task 'bogus'"),
             (("--lengths", "12"), "--lengths: 12 is too short"),
             (("--tasks", "qa3", "--lengths", "64"), "too short for qa3"),
             (("--samples", "0"), "--samples must be >= 1"),
             (("--tasks", "none", "--samples", "2"), "--samples set, but no long-context task runs"),
             # the kernels forced where they cannot run: before, a traceback from the first forward (exit 1)
             (("--tasks", "none", "model.titans.kernel=triton"), "model.titans.kernel: ")]
    if os.environ.get("TRITON_INTERPRET") == "1":
        cases.pop()
    for args, message in cases:
        code, out, err = _eval(capsys, recipe, *args, "--out", root / "never.json")
        assert code == 2, (args, out, err)
        assert len(err.strip().splitlines()) == 1 and message in err, (args, err)
        assert out == ""
    assert sorted(root.rglob("*")) == before  # nothing written

    # a tokenizer that changed after prepare (here cut short) is named with the fix, before the checkpoint loads
    damaged = root.parent / f"{root.name}-damaged-data"
    shutil.copytree(root / "data", damaged)
    tokenizer = damaged / "tokenizer.model"
    tokenizer.write_bytes(tokenizer.read_bytes()[:1000])
    code, out, err = _eval(capsys, recipe, f"data.dir={damaged}", "--out", root / "never.json")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert f"{tokenizer}: 1000 bytes but meta.json records " in err and "`memtrain prepare RECIPE --force`" in err
    assert not (root / "never.json").exists()


# --------------------------------------------------------------------------------------------------
# End to end: MemoryLlama (model.type hf + memory.type memory_llama) on a tiny random Llama


@pytest.fixture(scope="module")
def memory_llama_run(tmp_path_factory):
    from memtrain.config import load_recipe
    from memtrain.data.builtin import builtin_documents
    from memtrain.data.prepare import prepare

    root = tmp_path_factory.mktemp("longctx-llama")
    make_tiny_llama(root / "tiny-llama", documents=300, layers=2)
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in builtin_documents(0)[::20]))
    recipe = {
        "run": {"name": "longctx-llama", "seed": 3, "device": "cpu", "dir": str(root / "run")},
        "model": {"type": "hf", "pretrained": str(root / "tiny-llama"), "max_seq_len": SEQ},
        "memory": {"type": "memory_llama", "memory_llama": {"position": "alma", "heads": 2, "chunk_size": 8,
                                                            "lora": {"r": 4, "alpha": 8}}},
        "data": {"dir": str(root / "data"), "sources": [str(root / "docs.jsonl")], "seq_len": SEQ,
                 "val_fraction": 0.05, "tokenizer": {"path": str(root / "tiny-llama")}},
        "train": {"max_steps": 2, "global_batch_tokens": 2 * SEQ, "micro_batch_size": 2,
                  "schedule": {"kind": "cosine", "warmup": "1 steps"}, "eval": {"every_steps": 2, "batches": 1}},
        "checkpoint": {"every_steps": 2, "keep_last": 1},
        "logging": {"every_steps": 2, "tensorboard": False},
    }
    path = root / "llama.yaml"
    path.write_text(yaml.safe_dump(recipe))
    prepare(load_recipe(path))
    train_in_subprocess(path, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return root, path


def test_eval_memory_llama_long_context(memory_llama_run, capsys):
    """Runs by default (all tasks), in a window of the Llama's 64-token context: every prompt is
    left-truncated and counted; the same checkpoint evaluated twice gives the same predictions."""
    root, recipe = memory_llama_run
    target = root / "a.json"
    code, out, err = _eval(capsys, recipe, "--lengths", "768", "--samples", "1", "--max-new-tokens", "3",
                           "--batches", "1", "--out", target)
    assert code == 0, err
    report = json.loads(target.read_text())
    assert report["model"]["type"] == "hf" and report["memory"] == {"type": "memory_llama"}
    assert report["modes"] == ["none"] and math.isfinite(report["perplexity"]["none"]["perplexity"])
    lc = report["long_context"]
    assert lc["tasks"] == parse_tasks("niah,babilong") and lc["all"]["count"] == 8
    assert lc["context"] == {"mode": "window", "max_context": 64, "call_tokens": None, "prompt_budget": 62}
    assert lc["truncated"] == lc["all"]["truncated"] == 8 and lc["by_length"]["768"]["truncated"] == 8
    assert lc["memory"].startswith("fresh per sample") and not lc["bos"]
    assert all(e["truncated"] and 62 < e["prompt_tokens"] <= 768 for e in lc["examples"])
    assert 0.0 <= lc["all"]["accuracy"] <= 1.0
    assert "8 left-truncated to 62 tokens to fit the model's 64-token context" in out
    # Deterministic: another run (other batch composition) predicts the same.
    code, _, err = _eval(capsys, recipe, "--tasks", "qa1,passkey", "--lengths", "768", "--samples", "1",
                         "--max-new-tokens", "3", "--batches", "0", "--out", root / "b.json")
    assert code == 0, err
    again = {e["task"]: e["prediction"] for e in json.loads((root / "b.json").read_text())["long_context"]["examples"]}
    assert again == {e["task"]: e["prediction"] for e in lc["examples"] if e["task"] in again}
