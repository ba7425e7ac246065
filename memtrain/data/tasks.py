"""Offline long-context evaluation data: single needle in a haystack and BABILong-style fact chaining.

Everything is generated from templates and a seed; nothing is downloaded.

- **S-NIAH** (Titans Section 5.3, RULER's single needle in a haystack, Hsieh et al. 2024):
  ``"passkey"`` (S-NIAH-PK: "The pass key is 3920571. Remember it. 3920571 is the pass key." in
  RULER's repeated filler "The grass is green. The sky is blue. ..."), ``"number"`` (S-NIAH-N: "One
  of the special magic numbers for {key} is: {7 digits}.") and ``"word"`` (S-NIAH-W: "One of the
  special magic words for {key} is: {word}."), the latter two in a haystack of real sentences
  (:func:`memtrain.data.builtin.builtin_documents`). The needle is inserted at a relative depth
  (0 = start of the context, 1 = end) at a document / sentence boundary.
- **BABILong** (Titans Section 5.4, Kuratov et al. 2024; bAbI tasks qa1-qa5, thesis Table 4.1):
  ``"qa1"`` single supporting fact ("Where is Mary?"), ``"qa2"`` two supporting facts ("Where is
  the football?" -- who picked it up, where they went), ``"qa3"`` three supporting facts ("Where
  was the football before the kitchen?"), ``"qa4"`` two-argument relations ("What is east of the
  hallway?"), ``"qa5"`` three-argument relations ("Who gave the apple to Fred?"). A small world
  simulator produces consistent facts with seeded names, places and objects; the facts keep their
  order and are scattered at random boundaries of the filler text, as in BABILong.

Each example is ``{"task", "context", "question", "answer", "length", "depth", "n_tokens"}``:
``length`` is the target length bucket, ``n_tokens = length_fn(format_prompt(example)) <= length``
(the whole prompt fits the bucket, as in RULER), ``depth`` is the needle's relative position -- for
BABILong that of the earliest supporting fact, rounded to the nearest quarter. ``length_fn``
defaults to a whitespace word count; pass a tokenizer's counter for token lengths, e.g.
``lambda s: len(tok(s, add_special_tokens=False).input_ids)``.

**Training documents** (:func:`task_documents`, the ``builtin:tasks`` source of
:mod:`memtrain.data.sources`): the same formats written as ``format_prompt(example) + " " + answer``,
generated with :data:`TRAIN_SEED` (the evaluation uses seed 0, ``memtrain.eval.longctx.TASK_SEED``, so
no evaluation example is trained on) at lengths that fit the training sequence length, with S-NIAH
needles at uniformly random depths. At small scale a model does not learn needle retrieval zero-shot
from prose (Titans Section 5.3 evaluates models pretrained on 15-30B tokens), so the reproduction of
Table 2 trains on the task formats at a short context and tests at 1x-8x that context.

Scoring (:func:`score`) follows the thesis protocol (Section 4.2.3): a prediction is correct when it
contains the answer as a whole word (case-insensitive), accuracy per task, length, depth and
(length, depth) cell. :func:`babilong_correct` is BABILong's own, stricter rule (the benchmark's scorer,
which the Titans paper follows): the first sentence must name the answer and no other of the task's
labels, so a list of places does not count. :func:`generate` is deterministic in its arguments (per-example generators
seeded from ``(seed, task, length, depth, index)``, independent of ``PYTHONHASHSEED``).
"""

from __future__ import annotations

import bisect
import functools
import itertools
import random
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

NIAH_TASKS = ("passkey", "number", "word")
BABILONG_TASKS = ("qa1", "qa2", "qa3", "qa4", "qa5")
TASKS = NIAH_TASKS + BABILONG_TASKS
DEFAULT_LENGTHS = (2048, 4096, 8192, 16384)
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
HAYSTACKS = ("builtin", "repeat")
PROMPT = "{context}\n\nQuestion: {question}\nAnswer:"
RULER_FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")

_ADJECTIVES = (
    "abundant", "brave", "calm", "clever", "curious", "eager", "elegant", "fancy", "fierce", "gentle", "glossy",
    "grumpy", "hollow", "humble", "icy", "jolly", "lively", "lucky", "mighty", "nimble", "odd", "polite", "proud",
    "quiet", "rapid", "rusty", "shiny", "silent", "sleepy", "smooth", "sour", "spicy", "steady", "swift", "tame",
    "tender", "tidy", "vast", "wary", "witty", "zealous", "amber", "crimson", "golden", "violet", "scarlet",
)
_NOUNS = (
    "anchor", "badger", "beacon", "canyon", "castle", "comet", "crater", "dolphin", "falcon", "forest", "glacier",
    "harbor", "island", "jungle", "kettle", "lantern", "meadow", "mirror", "needle", "orchard", "otter", "parrot",
    "pebble", "pillow", "puzzle", "quartz", "rabbit", "ribbon", "saddle", "statue", "summit", "tunnel", "valley",
    "violin", "walrus", "willow", "window", "wizard", "yacht", "zebra", "cactus", "hammock", "lobster", "marble",
)
_VALUE_WORDS = (
    "apricot", "blizzard", "caravan", "daffodil", "emerald", "firefly", "gondola", "hazelnut", "igloo", "juniper",
    "kaleidoscope", "lighthouse", "mandolin", "nectarine", "observatory", "pinwheel", "quicksilver", "raspberry",
    "sandcastle", "tambourine", "umbrella", "vineyard", "waterfall", "xylophone", "yearling", "zeppelin",
    "avalanche", "bonfire", "cinnamon", "driftwood", "eclipse", "flamingo", "gingerbread", "hurricane",
    "icicle", "jellyfish", "kingfisher", "lagoon", "marshmallow", "nightingale", "origami", "peppermint",
)
NAMES = ("Mary", "John", "Sandra", "Daniel", "Fred", "Jeff", "Bill", "Julie", "Emily", "Gertrude", "Winona",
         "Lily", "Bernhard", "Greg", "Brian", "Jessica", "Yann", "Antoine", "Sumit", "Oliver")
PLACES = ("bathroom", "hallway", "kitchen", "garden", "office", "bedroom", "cinema", "park", "school",
          "library", "garage", "cellar", "balcony", "attic")
OBJECTS = ("football", "apple", "milk", "book", "umbrella", "key", "box", "hat", "guitar", "ball", "lamp",
           "pencil", "banana", "camera")
DIRECTIONS = {"north": "south", "south": "north", "east": "west", "west": "east"}
MOVE_VERBS = ("moved to", "went to", "journeyed to", "travelled to", "went back to")
GET_VERBS = ("picked up", "got", "grabbed", "took")
DROP_VERBS = ("dropped", "discarded", "put down", "left")
GIVE_VERBS = ("gave", "handed", "passed")
_FACTS = {"qa1": (2, 10), "qa2": (6, 24), "qa3": (10, 32), "qa4": (2, 2), "qa5": (4, 24)}  # facts per sample
# Every answer a task can have (BABILong's task labels): places for qa1-qa4, people and objects for qa5.
TASK_LABELS = {**{t: PLACES for t in ("qa1", "qa2", "qa3", "qa4")}, "qa5": NAMES + OBJECTS}


def word_count(text: str) -> int:
    """The default ``length_fn``: whitespace-separated words."""
    return len(text.split())


def format_prompt(example: dict, template: str = PROMPT) -> str:
    """The model input for an example: ``template`` with ``{context}`` and ``{question}``."""
    return template.format(context=example["context"], question=example["question"])


def is_correct(prediction: str, answer: str) -> bool:
    """The answer appears in the prediction as a whole word / number (case-insensitive)."""
    return re.search(rf"(?<![\w]){re.escape(answer)}(?![\w])", prediction, flags=re.IGNORECASE) is not None


def babilong_correct(prediction: str, example: dict) -> bool:
    """BABILong's scoring rule (Kuratov et al. 2024: the benchmark's own scorer, which the Titans paper's
    BABILong results follow) for a qa1-qa5 example: only the prediction's first sentence counts (up to the
    first full stop, or a "Question" the model goes on to write), and among the task's labels
    (:data:`TASK_LABELS`) it must name the answer and nothing else, labels the question names aside. Labels
    match as whole words, case-insensitive (the benchmark matches substrings, but memtrain's labels include
    "hat" and "key"). An S-NIAH example is scored by :func:`is_correct`. Stricter than the thesis protocol of
    :func:`is_correct`, which a list of every place passes."""
    if example["task"] not in TASK_LABELS:
        return is_correct(prediction, example["answer"])
    first = re.split(r"question", prediction.split(".")[0], flags=re.IGNORECASE)[0]
    named = {label.lower() for label in TASK_LABELS[example["task"]]
             if is_correct(first, label) and not is_correct(example["question"], label)}
    return named == {example["answer"].lower()}


# -------------------------------------------------------------------------------------------------
# Haystacks


@functools.lru_cache(maxsize=2)
def _builtin_units(seed: int = 0) -> tuple[str, ...]:
    from memtrain.data.builtin import builtin_documents

    docs = [" ".join(d.split()) for d in builtin_documents(seed)]
    random.Random(f"haystack:{seed}").shuffle(docs)
    return tuple(docs)


def _units(haystack: str) -> Sequence[str]:
    if haystack == "builtin":
        return _builtin_units(0)
    if haystack == "repeat":
        return RULER_FILLER
    raise ValueError(f"unknown haystack {haystack!r}; expected one of {', '.join(HAYSTACKS)}")


def _fill(rng: random.Random, haystack: str, budget: int, length_fn: Callable[[str], int]) -> list[str]:
    """Haystack units in order from a random start (RULER's filler: from its start) within ``budget``;
    a unit that does not fit is skipped, and filling stops after 64 misses in a row."""
    units = _units(haystack)
    i = 0 if haystack == "repeat" else rng.randrange(len(units))
    out, used, misses = [], 0, 0
    while misses < 64:
        u = units[i % len(units)]
        i += 1
        n = length_fn(u)
        if used + n > budget:
            misses += 1
            continue
        out.append(u)
        used, misses = used + n, 0
        if n <= 0:  # pragma: no cover - degenerate length_fn
            raise ValueError("length_fn must count at least 1 per haystack unit")
    return out


def _assemble(rng, haystack, length, length_fn, question, inserts: list[tuple[float, str]],
              template) -> tuple[str, int, list[int]]:
    """Place ``(depth, sentence)`` inserts between filler units (in the given order for equal slots)
    so that the prompt fits ``length``.

    Returns ``(context, n_tokens, offsets)`` with the character offset of every insert. Filler units
    are dropped from the end while the measured prompt is too long (a tokenizer's count is not
    exactly additive).
    """
    if any(a[0] > b[0] for a, b in zip(inserts, inserts[1:])):
        raise ValueError("inserts must be sorted by depth")
    fixed = length_fn(template.format(context=" ".join(s for _, s in inserts), question=question))
    if fixed > length:
        raise ValueError(f"length {length} is too short for the question and its facts ({fixed})")
    filler = _fill(rng, haystack, length - fixed, length_fn)
    while True:
        # the boundary whose share of the filler's length is nearest each depth
        cum = list(itertools.accumulate((length_fn(u) for u in filler), initial=0))
        total = max(1, cum[-1])
        slots = []
        for d, _ in inserts:
            k = bisect.bisect_left(cum, d * total)
            slots.append(k if k == 0 or k == len(cum) or cum[k] - d * total <= d * total - cum[k - 1] else k - 1)
            slots[-1] = min(slots[-1], len(filler))
        parts: list[tuple[str, int]] = []  # (text, insert index or -1)
        j = 0
        for k in range(len(filler) + 1):
            while j < len(inserts) and slots[j] <= k:
                parts.append((inserts[j][1], j))
                j += 1
            if k < len(filler):
                parts.append((filler[k], -1))
        offsets, pos, texts = [0] * len(inserts), 0, []
        for text, j in parts:
            if j >= 0:
                offsets[j] = pos
            texts.append(text)
            pos += len(text) + 1
        context = " ".join(texts)
        n = length_fn(template.format(context=context, question=question))
        if n <= length or not filler:
            return context, n, offsets
        filler.pop()


# -------------------------------------------------------------------------------------------------
# S-NIAH


def _niah_example(task: str, rng: random.Random, length: int, depth: float, haystack: str,
                  length_fn, template) -> dict:
    for _ in range(100):  # the value must not occur in the haystack itself
        example = _niah_try(task, rng, length, depth, haystack, length_fn, template)
        if example["context"].count(example["answer"]) == (2 if task == "passkey" else 1):
            return example
    raise RuntimeError("could not place a unique needle")  # pragma: no cover


def _niah_try(task: str, rng: random.Random, length: int, depth: float, haystack: str, length_fn, template) -> dict:
    key = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
    if task == "passkey":
        value = str(rng.randrange(1_000_000, 10_000_000))
        needle = f"The pass key is {value}. Remember it. {value} is the pass key."
        question = "What is the pass key?"
    elif task == "number":
        value = str(rng.randrange(1_000_000, 10_000_000))
        needle = f"One of the special magic numbers for {key} is: {value}."
        question = f"What is the special magic number for {key} mentioned in the provided text?"
    else:
        value = rng.choice(_VALUE_WORDS)
        needle = f"One of the special magic words for {key} is: {value}."
        question = f"What is the special magic word for {key} mentioned in the provided text?"
    context, n, _ = _assemble(rng, haystack, length, length_fn, question, [(depth, needle)], template)
    return {"task": task, "context": context, "question": question, "answer": value, "length": length,
            "depth": depth, "n_tokens": n}


# -------------------------------------------------------------------------------------------------
# BABILong (bAbI qa1-qa5 world simulator)


class _World:
    """People move between places and pick up, drop and give objects; records the facts stated."""

    def __init__(self, rng: random.Random, people: list[str], places: list[str], objects: list[str]):
        self.rng, self.people, self.places, self.objects = rng, people, places, objects
        self.where: dict[str, str] = {}            # person -> place
        self.holder: dict[str, Optional[str]] = {o: None for o in objects}
        self.obj_place: dict[str, Optional[str]] = {o: None for o in objects}
        self.trace: dict[str, list[tuple[str, int]]] = {o: [] for o in objects}  # (place, fact index)
        self.facts: list[str] = []
        self.last_move: dict[str, int] = {}
        self.got: dict[str, int] = {}              # object -> fact index of its current holder's pick-up
        self.gives: list[tuple[str, str, str, int]] = []  # (giver, object, receiver, fact index)

    def _locate(self, o: str, place: Optional[str]) -> None:
        if place is not None and (not self.trace[o] or self.trace[o][-1][0] != place):
            self.trace[o].append((place, len(self.facts) - 1))
        self.obj_place[o] = place

    def move(self, p: str) -> None:
        place = self.rng.choice([x for x in self.places if x != self.where.get(p)])
        self.facts.append(f"{p} {self.rng.choice(MOVE_VERBS)} the {place}.")
        self.where[p], self.last_move[p] = place, len(self.facts) - 1
        for o, h in self.holder.items():
            if h == p:
                self._locate(o, place)

    def get(self, p: str, o: str) -> None:
        self.facts.append(f"{p} {self.rng.choice(GET_VERBS)} the {o}.")
        self.holder[o], self.got[o] = p, len(self.facts) - 1
        self._locate(o, self.where.get(p))

    def drop(self, p: str, o: str) -> None:
        self.facts.append(f"{p} {self.rng.choice(DROP_VERBS)} the {o}.")
        self.holder[o] = None
        self._locate(o, self.where.get(p))

    def give(self, p: str, o: str, q: str) -> None:
        self.facts.append(f"{p} {self.rng.choice(GIVE_VERBS)} the {o} to {q}.")
        self.holder[o] = q
        self.gives.append((p, o, q, len(self.facts) - 1))
        self._locate(o, self.where.get(q))

    def random_event(self, allow_drop: bool = True) -> None:
        rng = self.rng
        held = [o for o, h in self.holder.items() if h is not None]
        free = [o for o, h in self.holder.items() if h is None]
        r = rng.random()
        if r < 0.25 and free:
            o = rng.choice(free)
            # an object lying somewhere can only be picked up there; a never-seen one by anyone
            here = [p for p in self.people if p in self.where
                    and (self.obj_place[o] is None or self.where[p] == self.obj_place[o])]
            if here:
                self.get(rng.choice(here), o)
            else:
                self.move(rng.choice(self.people))
        elif r < 0.35 and held and allow_drop:
            o = rng.choice(held)
            self.drop(self.holder[o], o)
        else:
            self.move(rng.choice(self.people))


def _babilong_facts(task: str, rng: random.Random, num_facts: int) -> tuple[list[str], str, str, list[int]]:
    """``(facts, question, answer, supporting fact indices)`` for one qa1-qa5 sample (retried until valid)."""
    for _ in range(1000):
        people = rng.sample(NAMES, rng.randint(2, 4) if task != "qa5" else rng.randint(3, 4))
        places = rng.sample(PLACES, 6)
        objects = rng.sample(OBJECTS, rng.randint(2, 3))
        w = _World(rng, people, places, objects)
        if task == "qa1":
            while len(w.facts) < num_facts:
                w.move(rng.choice(people))
            p = rng.choice(list(w.where))
            return w.facts, f"Where is {p}?", w.where[p], [w.last_move[p]]
        if task == "qa4":
            a, b, c = rng.sample(places, 3)
            d = rng.choice(list(DIRECTIONS))
            d2 = rng.choice([x for x in DIRECTIONS if x != d])
            facts = [f"The {a} is {d} of the {b}.", f"The {c} is {d2} of the {b}."]
            rng.shuffle(facts)
            sup = [facts.index(f"The {a} is {d} of the {b}.")]
            if rng.random() < 0.5:
                return facts, f"What is {d} of the {b}?", a, sup
            return facts, f"What is the {b} {DIRECTIONS[d]} of?", a, sup
        if task == "qa5":
            holders = {}
            for o in objects:
                p = rng.choice(people)
                w.get(p, o)
                holders[o] = p
            while len(w.facts) < num_facts:
                if rng.random() < 0.6:
                    o = rng.choice(objects)
                    q = rng.choice([x for x in people if x != w.holder[o]])
                    w.give(w.holder[o], o, q)
                else:
                    w.move(rng.choice(people))
            if not w.gives:
                continue
            giver, o, recv, idx = rng.choice(w.gives)
            forms = []
            if sum(1 for g in w.gives if g[1] == o and g[2] == recv) == 1:
                forms.append((f"Who gave the {o} to {recv}?", giver))
            if sum(1 for g in w.gives if g[0] == giver and g[2] == recv) == 1:
                forms.append((f"What did {giver} give to {recv}?", o))
            if sum(1 for g in w.gives if g[0] == giver and g[1] == o) == 1:
                forms.append((f"Who did {giver} give the {o} to?", recv))
            if sum(1 for g in w.gives if g[1] == o) == 1:
                forms.append((f"Who received the {o}?", recv))
            if not forms:
                continue
            q, ans = rng.choice(forms)
            return w.facts, q, ans, [idx]
        # qa2 / qa3: everyone starts somewhere, then random events
        for p in people:
            w.move(p)
        while len(w.facts) < num_facts:
            w.random_event(allow_drop=task == "qa2")
        if task == "qa2":
            cands = [o for o in objects if w.holder[o] is not None and w.last_move[w.holder[o]] > w.got[o]]
            if not cands:
                continue
            o = rng.choice(cands)
            h = w.holder[o]
            return w.facts, f"Where is the {o}?", w.where[h], [w.got[o], w.last_move[h]]
        # qa3: "Where was the O before the P?" with P visited once by O
        opts = []
        for o in objects:
            places_seq = [pl for pl, _ in w.trace[o]]
            for i in range(1, len(places_seq)):
                if places_seq.count(places_seq[i]) == 1:
                    opts.append((o, i))
        if not opts:
            continue
        o, i = rng.choice(opts)
        (prev, i_prev), (cur, i_cur) = w.trace[o][i - 1], w.trace[o][i]
        sup = sorted({i_prev, i_cur, w.got.get(o, i_prev)})
        return w.facts, f"Where was the {o} before the {cur}?", prev, sup
    raise RuntimeError(f"could not generate a valid {task} sample")  # pragma: no cover


def _babilong_example(task: str, rng: random.Random, length: int, haystack: str, length_fn, template,
                      num_facts: Optional[int]) -> dict:
    lo, hi = _FACTS[task]
    facts, question, answer, support = _babilong_facts(task, rng, num_facts or rng.randint(lo, hi))
    depths = sorted(rng.random() for _ in facts)
    context, n, offsets = _assemble(rng, haystack, length, length_fn, question, list(zip(depths, facts)), template)
    rel = offsets[min(support)] / max(1, len(context))  # the first supporting fact's relative position
    return {"task": task, "context": context, "question": question, "answer": answer, "length": length,
            "depth": round(rel * 4) / 4, "n_tokens": n, "facts": facts, "supporting": support}


# -------------------------------------------------------------------------------------------------
# Public API


def generate(task: str, num_samples: int = 10, lengths: Iterable[int] = DEFAULT_LENGTHS,
             depths: Iterable[float] = DEFAULT_DEPTHS, seed: int = 0, haystack: Optional[str] = None,
             length_fn: Callable[[str], int] = word_count, template: str = PROMPT,
             num_facts: Optional[int] = None) -> list[dict]:
    """Examples of ``task`` (one of :data:`TASKS`), deterministic in the arguments.

    S-NIAH: ``num_samples`` per (length, depth) cell; haystack default ``"repeat"`` for
    ``passkey``, ``"builtin"`` otherwise. BABILong: ``num_samples`` per length (the depth follows
    from where the facts land; ``depths`` is unused); haystack default ``"builtin"``; ``num_facts``
    fixes the number of facts (default: a task-dependent random number, like Table 4.1).
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}")
    lengths, depths = [int(n) for n in lengths], [float(d) for d in depths]
    if any(not 0.0 <= d <= 1.0 for d in depths):
        raise ValueError("depths must lie in [0, 1]")
    haystack = haystack or ("repeat" if task == "passkey" else "builtin")
    out = []
    for length in lengths:
        if task in NIAH_TASKS:
            for depth in depths:
                for i in range(num_samples):
                    rng = random.Random(f"{seed}:{task}:{length}:{depth}:{i}")
                    out.append(_niah_example(task, rng, length, depth, haystack, length_fn, template))
        else:
            for i in range(num_samples):
                rng = random.Random(f"{seed}:{task}:{length}:{i}")
                out.append(_babilong_example(task, rng, length, haystack, length_fn, template, num_facts))
    return out


def generate_niah(num_samples: int = 10, tasks: Sequence[str] = NIAH_TASKS, seed: int = 0, **kw) -> list[dict]:
    """The three S-NIAH tasks of Titans Table 2 (``**kw`` as for :func:`generate`)."""
    return [e for t in tasks for e in generate(t, num_samples, seed=seed, **kw)]


def generate_babilong(num_samples: int = 10, tasks: Sequence[str] = BABILONG_TASKS, seed: int = 0, **kw) -> list[dict]:
    """BABILong-style qa1-qa5 (``**kw`` as for :func:`generate`)."""
    return [e for t in tasks for e in generate(t, num_samples, seed=seed, **kw)]


def score(predictions: Sequence[str], examples: Sequence[dict]) -> dict:
    """Accuracy overall and per bucket: ``{"accuracy", "n", "by_task", "by_length", "by_depth",
    "by_length_depth", "by_task_length"}`` (bucket dicts map a key -- ``length``, ``depth``,
    ``(length, depth)``, ``(task, length)`` -- to an accuracy in [0, 1])."""
    if len(predictions) != len(examples):
        raise ValueError(f"{len(predictions)} predictions for {len(examples)} examples")
    buckets: dict[str, dict] = {k: defaultdict(list) for k in
                                ("by_task", "by_length", "by_depth", "by_length_depth", "by_task_length")}
    hits = []
    for pred, ex in zip(predictions, examples):
        ok = is_correct(pred, ex["answer"])
        hits.append(ok)
        buckets["by_task"][ex.get("task")].append(ok)
        buckets["by_length"][ex["length"]].append(ok)
        buckets["by_depth"][ex["depth"]].append(ok)
        buckets["by_length_depth"][(ex["length"], ex["depth"])].append(ok)
        buckets["by_task_length"][(ex.get("task"), ex["length"])].append(ok)
    out: dict = {"accuracy": sum(hits) / len(hits) if hits else 0.0, "n": len(hits)}
    for name, b in buckets.items():
        out[name] = {k: sum(v) / len(v) for k, v in sorted(b.items(), key=lambda kv: str(kv[0]))}
    return out


def to_scalars(result: dict, prefix: str = "eval") -> dict[str, float]:
    """Flatten :func:`score`'s result to ``{prefix}/accuracy``, ``{prefix}/length_2048``, ... for logging."""
    out = {f"{prefix}/accuracy": result["accuracy"]}
    for name, b in result.items():
        if name.startswith("by_"):
            for k, v in b.items():
                key = "_".join(str(x) for x in k) if isinstance(k, tuple) else str(k)
                out[f"{prefix}/{name[3:]}/{key}"] = v
    return out


# -------------------------------------------------------------------------------------------------
# Training documents (the builtin:tasks source)


TRAIN_SEED = 1  # != the evaluation's seed 0 (memtrain.eval.longctx.TASK_SEED): no evaluation example is trained on
# Bump when the training documents change, so data prepared with builtin:tasks is rebuilt.
TASKS_CORPUS_VERSION = 2


@dataclass(frozen=True)
class TaskCorpus:
    """How many ``builtin:tasks`` training examples, and how long. The tokenizer is trained after the
    sources are read, so lengths are whitespace words (:func:`word_count`) times ``tokens_per_word``, a
    proxy above the tokens per word of this text (2.0 on average with the 2048-piece unigram tokenizer
    of ``recipes/reproduce-titans.yaml``: seven-digit numbers take several pieces) so that an example
    fits ``seq_len`` tokens (the longest came to 0.96 x seq_len there)."""

    # Examples of each of the 8 tasks: 2000 (every S-NIAH example a distinct needle; with 400, a
    # 4-layer model trained 200 steps learned the answer format but never copied a needle).
    per_task: int = 2000
    min_fill: float = 0.3  # an example's length is drawn uniformly in [min_fill, max_fill] x seq_len (proxy tokens)
    max_fill: float = 0.95
    tokens_per_word: float = 2.5
    seed: int = TRAIN_SEED


def task_documents(seq_len: int, corpus: TaskCorpus = TaskCorpus()) -> list[str]:
    """``corpus.per_task`` training documents per task of :data:`TASKS`, each ``format_prompt(example) +
    " " + answer``, deterministic in the arguments. S-NIAH needles sit at uniformly random depths; a
    BABILong sample whose facts do not fit its length is drawn again with the task's fewest facts, and
    left out if even those do not fit (short ``seq_len``)."""
    if corpus.seed == 0:
        raise ValueError("TaskCorpus.seed 0 is the evaluation's seed; training examples need another")
    rng = random.Random(f"tasks-corpus:{corpus.seed}")
    docs = []
    for task in TASKS:
        for i in range(corpus.per_task):
            words = int(rng.uniform(corpus.min_fill, corpus.max_fill) * seq_len / corpus.tokens_per_word)
            depth = round(rng.random(), 3)
            seed = f"{corpus.seed}.{i}"
            example = None
            for num_facts in ((None, _FACTS[task][0]) if task in BABILONG_TASKS else (None,)):
                try:
                    example = generate(task, 1, lengths=[words], depths=[depth], seed=seed, num_facts=num_facts)[0]
                    break
                except ValueError:
                    continue
            if example is not None:
                docs.append(format_prompt(example) + " " + example["answer"])
    return docs


__all__ = [
    "TASKS_CORPUS_VERSION", "TRAIN_SEED", "TaskCorpus", "task_documents",
    "BABILONG_TASKS", "DEFAULT_DEPTHS", "DEFAULT_LENGTHS", "NIAH_TASKS", "PROMPT", "TASKS", "TASK_LABELS",
    "babilong_correct", "format_prompt",
    "generate", "generate_babilong", "generate_niah", "is_correct", "score", "to_scalars", "word_count",
]
