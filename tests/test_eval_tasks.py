"""Offline long-context evaluation data (memtrain.data.tasks): S-NIAH and BABILong-style
qa1-qa5. Determinism, lengths, needle depth, the answer recovered from the context by an independent
solver, scoring."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from memtrain.data.tasks import (
    BABILONG_TASKS, DEFAULT_DEPTHS, NIAH_TASKS, TASKS, format_prompt, generate, generate_babilong, generate_niah,
    is_correct, score, to_scalars, word_count,
)

LENGTHS = (2048, 4096, 16384)


@pytest.mark.parametrize("task", TASKS)
def test_deterministic(task):
    a = generate(task, 2, lengths=(2048,), seed=3)
    assert a == generate(task, 2, lengths=(2048,), seed=3)
    b = generate(task, 2, lengths=(2048,), seed=4)
    assert [e["context"] for e in a] != [e["context"] for e in b]


@pytest.mark.parametrize("task", TASKS)
def test_lengths_in_range(task):
    examples = generate(task, 2, lengths=LENGTHS, depths=(0.0, 0.5, 1.0), seed=0)
    for e in examples:
        assert set(e) >= {"context", "question", "answer", "length", "depth"}
        assert e["length"] in LENGTHS
        n = word_count(format_prompt(e))
        assert n == e["n_tokens"] and 0.97 * e["length"] <= n <= e["length"]
    assert {e["length"] for e in examples} == set(LENGTHS)


def test_custom_length_fn_is_respected():
    def chars(s: str) -> int:  # not additive over sentences, like a tokenizer
        return (len(s) + 3) // 4

    for task in ("number", "qa2"):
        for e in generate(task, 2, lengths=(2048, 8192), depths=(0.5,), length_fn=chars):
            assert 0.95 * e["length"] <= chars(format_prompt(e)) == e["n_tokens"] <= e["length"]


# -------------------------------------------------------------------------------------------------
# S-NIAH


@pytest.mark.parametrize("task", NIAH_TASKS)
def test_niah_answer_recoverable_at_depth(task):
    examples = generate(task, 3, lengths=(2048, 8192), depths=DEFAULT_DEPTHS, seed=1)
    assert {e["depth"] for e in examples} == set(DEFAULT_DEPTHS)
    for e in examples:
        ctx = e["context"]
        if task == "passkey":
            pattern = r"The pass key is (\d+)\. Remember it\. \1 is the pass key\."
        else:
            key = re.search(r"special magic (?:number|word) for (\S+) mentioned", e["question"]).group(1)
            pattern = rf"One of the special magic {task}s for {re.escape(key)} is: (\w+)\."
        found = [m for m in re.finditer(pattern, ctx)]
        assert len(found) == 1 and found[0].group(1) == e["answer"]
        assert ctx.count(e["answer"]) == (2 if task == "passkey" else 1)  # nowhere else in the haystack
        assert abs(found[0].start() / len(ctx) - e["depth"]) < 0.03


def test_niah_haystacks():
    passkey = generate("passkey", 1, lengths=(2048,), depths=(0.5,))[0]
    assert passkey["context"].startswith("The grass is green. The sky is blue.")
    number = generate("number", 1, lengths=(2048,), depths=(0.5,))[0]
    assert "ISO 3166" in number["context"] or "code" in number["context"]  # builtin documents
    assert len(generate_niah(1, lengths=(2048,), depths=(0.0,))) == 3


# -------------------------------------------------------------------------------------------------
# BABILong: an independent solver reads the facts back from the context

NAME = r"([A-Z][a-z]+)"
EVENT = re.compile(
    rf"{NAME} (?:moved to|went to|journeyed to|travelled to|went back to) the (\w+)\."
    rf"|{NAME} (?:picked up|got|grabbed|took) the (\w+)\."
    rf"|{NAME} (?:dropped|discarded|put down|left) the (\w+)\."
    rf"|{NAME} (?:gave|handed|passed) the (\w+) to {NAME}\."
    r"|The (\w+) is (north|south|east|west) of the (\w+)\."
)
OPPOSITE = {"north": "south", "south": "north", "east": "west", "west": "east"}


def solve(context: str, question: str) -> tuple[str, list[str]]:
    """Answer a qa1-qa5 question from the context alone; also returns the facts it read."""
    where, holder, obj_at, trace, gives, rel, facts = {}, {}, {}, {}, [], [], []

    def put(o, place):
        obj_at[o] = place
        if place and (not trace.setdefault(o, []) or trace[o][-1] != place):
            trace[o].append(place)

    for m in EVENT.finditer(context):
        facts.append(m.group(0))
        g = m.groups()
        if g[0]:
            where[g[0]] = g[1]
            for o, h in holder.items():
                if h == g[0]:
                    put(o, g[1])
        elif g[2]:
            holder[g[3]] = g[2]
            put(g[3], where.get(g[2]))
        elif g[4]:
            holder[g[5]] = None
        elif g[6]:
            holder[g[7]] = g[8]
            gives.append((g[6], g[7], g[8]))
            put(g[7], where.get(g[8]))
        else:
            rel.append((g[9], g[10], g[11]))
    q = question
    if m := re.fullmatch(r"Where is (the )?(\w+)\?", q):
        x = m.group(2)
        return (where[x] if not m.group(1) else obj_at[x]), facts
    if m := re.fullmatch(r"Where was the (\w+) before the (\w+)\?", q):
        t = trace[m.group(1)]
        assert t.count(m.group(2)) == 1
        return t[t.index(m.group(2)) - 1], facts
    if m := re.fullmatch(r"What is (\w+) of the (\w+)\?", q):
        return [a for a, d, b in rel if d == m.group(1) and b == m.group(2)][0], facts
    if m := re.fullmatch(r"What is the (\w+) (\w+) of\?", q):
        return [a for a, d, b in rel if b == m.group(1) and OPPOSITE[d] == m.group(2)][0], facts
    if m := re.fullmatch(rf"Who gave the (\w+) to {NAME}\?", q):
        (ans,) = {p for p, o, r in gives if o == m.group(1) and r == m.group(2)}
        return ans, facts
    if m := re.fullmatch(rf"What did {NAME} give to {NAME}\?", q):
        (ans,) = {o for p, o, r in gives if p == m.group(1) and r == m.group(2)}
        return ans, facts
    if m := re.fullmatch(rf"Who did {NAME} give the (\w+) to\?", q):
        (ans,) = {r for p, o, r in gives if p == m.group(1) and o == m.group(2)}
        return ans, facts
    if m := re.fullmatch(r"Who received the (\w+)\?", q):
        (ans,) = {r for p, o, r in gives if o == m.group(1)}
        return ans, facts
    raise AssertionError(f"unknown question {q!r}")


@pytest.mark.parametrize("task", BABILONG_TASKS)
def test_babilong_answer_recoverable(task):
    examples = generate(task, 25, lengths=(2048,), seed=2) + generate(task, 2, lengths=(16384,), seed=2)
    for e in examples:
        answer, facts = solve(e["context"], e["question"])
        assert facts == e["facts"]            # the facts, in order, and nothing else in the filler matches
        assert answer == e["answer"], (e["question"], e["facts"])
        assert e["depth"] in DEFAULT_DEPTHS
        assert len(e["supporting"]) == {"qa1": 1, "qa2": 2, "qa4": 1, "qa5": 1}.get(task, len(e["supporting"]))
    assert len({e["question"] for e in examples}) > 5
    if task == "qa5":
        assert len({e["question"].split()[0:2][1] for e in examples}) >= 2  # several question forms


def test_babilong_num_facts_and_all_tasks():
    examples = generate("qa1", 3, lengths=(2048,), num_facts=8)
    assert all(len(e["facts"]) == 8 for e in examples)
    assert {e["task"] for e in generate_babilong(1, lengths=(2048,))} == set(BABILONG_TASKS)


def test_too_short_length_rejected():
    with pytest.raises(ValueError, match=r"length 20 is too short for the question and its facts"):
        generate("qa3", 1, lengths=(20,))
    with pytest.raises(ValueError, match="unknown task 'qa9'"):
        generate("qa9")


# -------------------------------------------------------------------------------------------------
# Scoring


def test_is_correct():
    assert is_correct("The pass key is 1234567.", "1234567")
    assert not is_correct("12345678", "1234567") and not is_correct("91234567", "1234567")
    assert is_correct("kitchen", "Kitchen") and is_correct("In the KITCHEN!", "kitchen")
    assert not is_correct("kitchens", "kitchen")


def test_score_buckets():
    examples = generate("number", 2, lengths=(2048, 4096), depths=(0.0, 1.0)) + generate("qa1", 2, lengths=(2048,))
    perfect = score([f"It is {e['answer']}." for e in examples], examples)
    assert perfect["accuracy"] == 1.0 and perfect["n"] == len(examples)
    assert set(perfect["by_length"]) == {2048, 4096} and set(perfect["by_task"]) == {"number", "qa1"}
    preds = [e["answer"] if e["length"] == 2048 else "no idea" for e in examples]
    result = score(preds, examples)
    assert result["by_length"] == {2048: 1.0, 4096: 0.0}
    assert result["by_length_depth"][(4096, 0.0)] == 0.0
    assert result["accuracy"] == pytest.approx(6 / 10)
    flat = to_scalars(result, "eval/niah")
    assert flat["eval/niah/accuracy"] == result["accuracy"] and flat["eval/niah/length/4096"] == 0.0
    assert flat["eval/niah/length_depth/2048_0.0"] == 1.0
    with pytest.raises(ValueError, match="1 predictions for 10 examples"):
        score(["x"], examples)


# --------------------------------------------------------------------------------------------------
# builtin:tasks training documents (memtrain.data.tasks.task_documents)


def test_training_documents_differ_from_evaluation_examples():
    from memtrain.data.tasks import TaskCorpus, task_documents
    from memtrain.eval.longctx import TASK_SEED

    corpus = TaskCorpus(per_task=30)
    docs = task_documents(256, corpus)
    assert len(docs) >= 30 * len(NIAH_TASKS) and docs == task_documents(256, corpus)
    # every training document is a prompt followed by its answer
    assert all(re.search(r"\n\nQuestion: .+\nAnswer: \S+$", d) for d in docs)
    # the evaluation's examples (seed 0) at the training documents' (word) lengths
    lengths = sorted({len(d.split()) for d in docs})[::7]
    evals = []
    for task in TASKS:
        for n in lengths:
            try:
                evals += generate(task, 2, lengths=[n], seed=TASK_SEED)
            except ValueError:  # too short for this task's facts
                pass
    assert evals
    eval_prompts = {format_prompt(e) for e in evals}
    train_prompts = {d.rsplit(" ", 1)[0] for d in docs}
    assert not eval_prompts & train_prompts
    # S-NIAH needle values (7-digit numbers) are never those of an evaluation example
    train_numbers = {m for d in docs for m in re.findall(r"\b\d{7}\b", d.split("\n\nQuestion")[0])}
    eval_numbers = {e["answer"] for e in evals if e["task"] in ("passkey", "number")}
    assert eval_numbers and not train_numbers & eval_numbers


def test_training_documents_fit_the_length_and_spread_the_needle():
    from memtrain.data.tasks import TaskCorpus, task_documents

    corpus = TaskCorpus(per_task=40)
    docs = task_documents(256, corpus)
    # the word proxy: at most max_fill * seq_len / tokens_per_word words of prompt
    limit = corpus.max_fill * 256 / corpus.tokens_per_word
    assert all(word_count(d.rsplit(" ", 1)[0]) <= limit for d in docs)
    passkey = [d for d in docs if "pass key" in d]
    depths = [d.index("The pass key is") / len(d.split("\n\nQuestion")[0]) for d in passkey]
    assert min(depths) < 0.2 and max(depths) > 0.8  # uniform depths, not all at one place
    with pytest.raises(ValueError, match="seed 0"):
        task_documents(256, TaskCorpus(seed=0))


def test_builtin_tasks_source_mixes_the_corpus_and_changes_the_fingerprint():
    from memtrain.config import load_recipe
    from memtrain.data.prepare import data_settings, fingerprint
    from memtrain.data.sources import read_documents

    docs = list(read_documents(["builtin:tasks"], seq_len=128))
    assert sum("\nAnswer: " in d for d in docs) > 1000 and sum("\nAnswer: " not in d for d in docs) > 10000
    base = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "reproduce-titans.yaml")
    other = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "reproduce-titans.yaml", ["data.sources=[builtin]"])
    assert fingerprint(data_settings(base)) != fingerprint(data_settings(other))
    assert data_settings(base)["tasks_version"] >= 1
