"""A built-in long-tail knowledge corpus with frequency-annotated probes, for demos and evaluation.

The paper motivates memories with long-tail knowledge: facts that appear rarely in the pretraining
data are the ones a plain model forgets, and its Figure 1 (right) plots accuracy on predicting the
atomic numbers of the 118 elements per bucket of how often each element appears in the training
set. Appendix B ("Elements atomic number") gives the task: complete "The atomic number of {name} is"
and compare the integer with the true atomic number. A web crawl is neither available offline nor
controlled, so this module builds a small corpus whose frequency distribution *is* controlled:

* Entities are the real records of :mod:`memtrain.data.builtin` (``periodictable`` elements,
  ``pycountry`` countries and, optionally, ISO 4217 currencies). Nothing is invented: in particular
  ``periodictable`` ships no discovery facts, so there are none here.
* Within each entity kind, a seeded random permutation assigns ranks 1..N (so frequency is not
  correlated with atomic number or alphabetical order), and the entity of rank ``r`` is the subject
  of ``max(1, round(max_docs_per_entity * r ** -exponent))`` documents: a Zipf-like law whose head
  appears hundreds of times and whose tail once. Ranks are drawn per kind, so every probe task spans
  the full head-to-tail range, as Figure 1 does for the elements alone.
* Every appearance is a separately rendered document (prose, question-and-answer or fact-card style,
  with a random subset of the entity's other facts, generic filler and sometimes a name-only mention
  of a related entity: the periodic-table or code-order neighbour), so repetitions are not copies.

Counting semantics (what :func:`longtail_counts` and :attr:`Probe.count` mean): an entity's count is
the number of documents whose subject it is; each of them states every probed fact of the entity
with the exact answer string. Other documents may mention the entity's *name* (a neighbour mention,
or a name inside an official name such as "... of China") but never together with any of its probed
answers. So, for every probe, the number of documents that both mention the entity by name (longest
match: "Guinea" inside "Papua New Guinea" is not a mention of Guinea) and contain the answer string
(not followed by a letter, digit or decimal part) is exactly ``count``. Generation checks this
invariant for every document and re-renders on a clash.

Probes (:func:`probes`) are the cloze prompts for these facts, e.g. "The atomic number of Iron is" ->
" 26" (Appendix B) or "The ISO alpha-3 code of Germany is" -> " DEU", each tagged with its entity's
training count and a frequency bucket:

* ``"head"``: ``count >= head_min`` (default 50),
* ``"tail"``: ``count <= tail_max`` (default 4),
* ``"torso"``: everything in between.

``read_documents(["builtin:longtail"])`` (see :mod:`memtrain.data.sources`) yields
:func:`longtail_documents` with its defaults. Output is a pure function of the arguments and the
installed package versions.
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence

from memtrain.data.builtin import Entity, _join, _num, country_facts, currency_facts, element_facts

# Bump when templates, entity selection or the frequency law change: the corpus, its counts and the
# probes all change with it.
LONGTAIL_VERSION = 1

KINDS = ("element", "country", "currency")
DEFAULT_KINDS = ("element", "country")
HEAD_MIN = 50  # documents; an entity seen at least this often is "head"
TAIL_MAX = 4  # documents; an entity seen at most this often is "tail"

# The probed facts of each kind: probe kind -> (prompt template, fact holding the answer). Every
# document about an entity states all of these, so one count serves every probe of the entity.
_PROBES: dict[str, dict[str, tuple[str, str]]] = {
    "element": {
        "atomic_number": ("The atomic number of {name} is", "number"),
        "symbol": ("The chemical symbol of {name} is", "symbol"),
    },
    "country": {
        "alpha_2": ("The ISO alpha-2 code of {name} is", "alpha_2"),
        "alpha_3": ("The ISO alpha-3 code of {name} is", "alpha_3"),
        "numeric": ("The ISO numeric code of {name} is", "numeric"),
    },
    "currency": {
        "currency_code": ("The ISO 4217 code of the currency {name} is", "code"),
        "currency_numeric": ("The ISO 4217 numeric code of the currency {name} is", "numeric"),
    },
}

# ISO 4217 entries that are not money of any country: precious metals (their names are element
# names, which would blur the atomic-number task), bond-market units, and the testing/no-currency codes.
_NOT_CURRENCIES = {"XAG", "XAU", "XPD", "XPT", "XBA", "XBB", "XBC", "XBD", "XTS", "XXX"}

_MAX_TRIES = 50  # re-renders of one document before giving up on distinctness / clash avoidance


@dataclass(frozen=True)
class Probe:
    """A cloze question about one fact; ``prompt + answer`` is the true statement.

    ``entity`` is the entity key (``"element:Fe"``, as in :func:`longtail_counts`), ``kind`` the probe
    kind (``"atomic_number"``, ``"symbol"``, ``"alpha_2"``, ``"alpha_3"``, ``"numeric"``,
    ``"currency_code"``, ``"currency_numeric"``), ``count`` the number of corpus documents stating it,
    ``bucket`` the frequency bucket of ``count`` and ``name`` the entity name used in the prompt.
    """

    prompt: str
    answer: str  # starts with a space: the continuation of the prompt
    entity: str
    kind: str
    count: int
    bucket: str
    name: str = ""


@dataclass(frozen=True)
class LongtailDoc:
    """One corpus document with its provenance (for analysis; the corpus itself is just the texts)."""

    text: str
    entity: str  # key of the subject, whose probed facts the document states
    rank: int  # the subject's frequency rank within its kind, 1 = most frequent
    mentions: tuple[str, ...] = field(default=())  # keys of other entities named (never with their answers)


# --------------------------------------------------------------------------------------------------
# Entities, ranks and counts


def entity_key(entity: Entity) -> str:
    """``"kind:key"``, unique across kinds (``"element:Fe"``, ``"country:DE"``, ``"currency:EUR"``)."""
    return f"{entity.kind}:{entity.key}"


def _display_name(name: str, common: Optional[str]) -> str:
    """A name usable inside a sentence: ISO's inverted forms ("Virgin Islands, British") read badly
    in prompts, so use pycountry's common name or undo the inversion; lists ("Bonaire, Sint Eustatius
    and Saba") stay as they are."""
    if common:
        return common
    if ", " in name:
        head, tail = name.split(", ", 1)
        if " and " not in tail:
            tail = tail[4:] if tail.startswith("The ") else tail
            return f"{tail} {head}"
    return name


@lru_cache(maxsize=None)
def _entities_of(kind: str) -> tuple[Entity, ...]:
    # the fact tables are static for an installed package version; cache them across calls
    if kind == "element":
        return tuple(element_facts())
    if kind == "country":
        import pycountry

        common = {c.alpha_2: getattr(c, "common_name", None) for c in pycountry.countries}
        out = []
        for e in country_facts():
            name = _display_name(e.name, common.get(e.key))
            facts = dict(e.facts)
            if facts.get("official_name") == name:
                del facts["official_name"]  # "official name of X is X" says nothing
            out.append(Entity("country", e.key, name, facts))
        return tuple(out)
    if kind == "currency":
        element_names = {e.name.lower() for e in element_facts()}
        currencies = currency_facts()
        # a name shared by two codes ("Bolívar Soberano": VED and VES) makes its probes ambiguous
        shared = {n for n, k in Counter(c.name for c in currencies).items() if k > 1}
        return tuple(e for e in currencies if e.key not in _NOT_CURRENCIES and e.facts.get("numeric")
                     and e.name.lower() not in element_names and e.name not in shared)
    raise ValueError(f"unknown entity kind {kind!r}; choose from {', '.join(KINDS)}")


def _check_kinds(kinds: Iterable[str]) -> tuple[str, ...]:
    kinds = tuple(dict.fromkeys(kinds))  # keep order, drop repeats
    if not kinds:
        raise ValueError(f"kinds is empty; choose from {', '.join(KINDS)}")
    for kind in kinds:
        if kind not in KINDS:
            raise ValueError(f"unknown entity kind {kind!r}; choose from {', '.join(KINDS)}")
    return kinds


def longtail_entities(kinds: Iterable[str] = DEFAULT_KINDS) -> list[Entity]:
    """The records the corpus is about, in table order (elements by atomic number, countries by ISO
    order); countries carry a readable display name (``"South Korea"``, ``"British Virgin Islands"``)."""
    return [e for kind in _check_kinds(kinds) for e in _entities_of(kind)]


def zipf_count(rank: int, max_docs_per_entity: int = 200, exponent: float = 1.1) -> int:
    """Documents for the entity of ``rank`` (1-based): ``max(1, round(max_docs * rank ** -exponent))``."""
    return max(1, round(max_docs_per_entity * rank ** -exponent))


def _check_law(max_docs_per_entity: int, exponent: float) -> None:
    if not isinstance(max_docs_per_entity, int) or max_docs_per_entity < 1:
        raise ValueError(f"max_docs_per_entity must be a positive integer, got {max_docs_per_entity!r}")
    if not exponent > 0:
        raise ValueError(f"exponent must be positive (about 1.0-1.2 for a Zipf law), got {exponent!r}")


def _ranked(seed: int, kind: str) -> list[Entity]:
    """The entities of ``kind`` in rank order: a seeded permutation, independent per kind and of the
    rendering stream (string seeds hash deterministically, unlike ``hash()``)."""
    order = list(_entities_of(kind))
    random.Random(f"memtrain.longtail/rank/{seed}/{kind}").shuffle(order)
    return order


def longtail_counts(seed: int = 0, max_docs_per_entity: int = 200, exponent: float = 1.1,
                    kinds: Iterable[str] = DEFAULT_KINDS) -> dict[str, int]:
    """Entity key -> number of corpus documents stating its probed facts, in rank order per kind.

    Cheap: it needs only the ranking, not the documents.
    """
    _check_law(max_docs_per_entity, exponent)
    return {entity_key(e): zipf_count(r, max_docs_per_entity, exponent)
            for kind in _check_kinds(kinds) for r, e in enumerate(_ranked(seed, kind), 1)}


def bucket_of(count: int, head_min: int = HEAD_MIN, tail_max: int = TAIL_MAX) -> str:
    """``"head"`` if ``count >= head_min``, ``"tail"`` if ``count <= tail_max``, else ``"torso"``."""
    if head_min <= tail_max:
        raise ValueError(f"head_min ({head_min}) must exceed tail_max ({tail_max})")
    return "head" if count >= head_min else "tail" if count <= tail_max else "torso"


def _answers(entity: Entity) -> dict[str, tuple[str, str]]:
    """Probe kind -> (prompt, answer) for one entity."""
    out = {}
    for kind, (template, fact) in _PROBES[entity.kind].items():
        value = entity.facts.get(fact)
        if value is not None and value != "":
            out[kind] = (template.format(name=entity.name), f" {value}")
    return out


def contains_answer(text: str, answer: str) -> bool:
    """Whether ``answer`` (e.g. ``" 26"``) occurs in ``text`` as a whole token: not followed by a letter,
    digit or decimal part, so " 26" does not match " 263" or " 26.98" but matches " 26." and " 26,"."""
    return re.search(re.escape(answer) + r"(?!\w|\.\d)", text) is not None


# --------------------------------------------------------------------------------------------------
# Name mentions: the longest entity name starting at each word, so "Guinea" inside "Papua New
# Guinea" or "Hong Kong" inside "Hong Kong Dollar" is not a mention. Element names are matched
# case-insensitively (prose writes "iron"); other names as written ("China" is not "china").

_WORD = re.compile(r"\w+")


class MentionFinder:
    """Finds which entities a text names; :func:`mentions` uses one for the default kinds."""

    def __init__(self, entities: Sequence[Entity]):
        # first word (lower-cased) -> [(name, key, case_insensitive)], longest name first
        self._by_first: dict[str, list[tuple[str, str, bool]]] = {}
        for e in entities:
            first = _WORD.match(e.name)
            if first is None:
                continue
            self._by_first.setdefault(first.group().lower(), []).append(
                (e.name, entity_key(e), e.kind == "element"))
        for cands in self._by_first.values():
            cands.sort(key=lambda c: -len(c[0]))

    def find(self, text: str) -> set[str]:
        found: set[str] = set()
        resume = 0  # end of the last match: words inside it are part of that name
        for m in _WORD.finditer(text):
            start = m.start()
            if start < resume or (start > 0 and (text[start - 1].isalnum() or text[start - 1] == "_")):
                continue
            for name, key, ci in self._by_first.get(m.group().lower(), ()):
                end = start + len(name)
                seg = text[start:end]
                if (seg.lower() == name.lower() if ci else seg == name) and not (
                        end < len(text) and (text[end].isalnum() or text[end] == "_")):
                    found.add(key)
                    resume = end
                    break
        return found


def mentions(text: str, kinds: Iterable[str] = DEFAULT_KINDS) -> set[str]:
    """Keys of the entities of ``kinds`` that ``text`` names (longest match, see the module docstring)."""
    return _finder(_check_kinds(kinds)).find(text)


@lru_cache(maxsize=None)
def _finder(kinds: tuple[str, ...]) -> MentionFinder:
    return MentionFinder(longtail_entities(kinds))


# --------------------------------------------------------------------------------------------------
# Rendering. Each kind has three document styles; every style states all probed facts of the subject
# with the answer preceded by a space (never "(26)"), so the probe answer occurs verbatim.


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def _style(rng: random.Random) -> str:
    return rng.choices(("prose", "qa", "card"), weights=(6, 2, 2))[0]


def _subset(rng: random.Random, items: list[Any], lo: int, hi: Optional[int] = None) -> list[Any]:
    hi = len(items) if hi is None else min(hi, len(items))
    return rng.sample(items, rng.randint(min(lo, hi), hi)) if items else []


def _assemble(rng: random.Random, style: str, first: list[str], rest: list[str], extra: list[str]) -> str:
    """Join the parts: ``first`` opens the document in order, ``rest`` (facts) and ``extra`` (filler,
    neighbour) follow in random order. Prose is one paragraph, with the facts before the extras so that
    "Its ..." sentences refer to the subject; question-and-answer and card documents are lines."""
    rng.shuffle(rest)
    rng.shuffle(extra)
    if style == "prose":
        return " ".join(first + rest + extra)
    body = rest + extra
    rng.shuffle(body)
    return "\n".join(first + body)


_ELEMENT_FILLER = [
    "The atomic number counts the protons in the nucleus and fixes the element's place in the periodic table.",
    "Isotopes of one element share its atomic number but differ in their number of neutrons.",
    "The periodic table lists the elements in order of increasing atomic number.",
    "Element names and symbols are approved by IUPAC.",
    "A chemical symbol has one or two letters, and only the first is a capital.",
    "Chemistry students are often asked to recall such values from memory.",
    "Reference tables give each element together with its symbol and its mass.",
]


def _element_doc(e: Entity, rng: random.Random, neighbours: tuple[Optional[str], Optional[str]]) -> str:
    f = e.facts
    kw: dict[str, Any] = dict(name=e.name, lname=e.name.lower(), sym=f["symbol"], num=f["number"])
    style = _style(rng)
    # other facts: (prose sentence options, question, answer, card row)
    side: list[tuple[list[str], str, str, str]] = []
    if "mass" in f:
        m = _num(f["mass"])
        side.append(([f"Its atomic mass is {m} u.", f"The atomic mass of {kw['lname']} is about {m} daltons.",
                      f"{e.name} has a relative atomic mass of {m}."],
                     f"What is the atomic mass of {kw['lname']}?", f"About {m} u.", f"Atomic mass: {m} u"))
    if "density" in f:
        d = _num(f["density"])
        at = f" at {_num(f['density_celsius'])} °C" if "density_celsius" in f else ""
        side.append(([f"Its density is {d} g/cm3{at}.",
                      f"{e.name} has a density of {d} grams per cubic centimetre{at}.",
                      f"The density of {kw['lname']} is about {d} g/cm3{at}."],
                     f"How dense is {kw['lname']}?", f"{d} g/cm3{at}.", f"Density: {d} g/cm3{at}"))
    if "covalent_radius" in f:
        r = _num(f["covalent_radius"])
        side.append(([f"Its covalent radius is {r} angstroms.",
                      f"The covalent radius of {kw['lname']} is about {r} Å."],
                     f"What is the covalent radius of {kw['lname']}?", f"About {r} Å.", f"Covalent radius: {r} Å"))
    if "crystal_structure" in f:
        cs = f["crystal_structure"]
        side.append(([f"Solid {kw['lname']} has a {cs} crystal structure.",
                      f"{e.name} crystallises in the {cs} structure."],
                     f"What is the crystal structure of solid {kw['lname']}?", f"{_cap(cs)}.",
                     f"Crystal structure: {cs}"))
    if "isotopes" in f:
        n, lo, hi = f["isotopes"]
        side.append(([f"{n} isotopes of {kw['lname']} are known, with mass numbers from {lo} to {hi}.",
                      f"Known isotopes of {kw['lname']} range from {kw['lname']}-{lo} to {kw['lname']}-{hi}."],
                     f"How many isotopes of {kw['lname']} are known?", f"{n}, with mass numbers from {lo} to {hi}.",
                     f"Known isotopes: {n}, mass numbers {lo} to {hi}"))
    if "natural_isotopes" in f:
        iso = _join([f"{kw['lname']}-{a} ({_num(p)}%)" for a, p in f["natural_isotopes"]])
        side.append(([f"Its naturally occurring isotopes are {iso}.", f"Natural {kw['lname']} consists of {iso}."],
                     f"Which isotopes of {kw['lname']} occur in nature?", f"{_cap(iso)}.", f"Natural isotopes: {iso}"))
    side.append(([f"Every atom of {kw['lname']} has {kw['num']} protons in its nucleus.",
                  f"A neutral atom of {kw['lname']} has {kw['num']} electrons."],
                 f"How many protons does an atom of {kw['lname']} have?", f"{kw['num']}.", f"Protons: {kw['num']}"))

    # a name-only mention of a periodic-table neighbour (real: it follows from the atomic numbers)
    prev, nxt = neighbours
    extra: list[str] = []
    if rng.random() < 0.3 and (prev or nxt):
        if prev and nxt:
            extra.append(rng.choice([
                f"In the periodic table, {kw['lname']} sits between {prev} and {nxt}.",
                f"{e.name} comes right after {prev} and right before {nxt} in the periodic table."]))
        elif prev:
            extra.append(f"In the periodic table, {kw['lname']} comes right after {prev}.")
        else:
            extra.append(f"In the periodic table, {kw['lname']} is followed by {nxt}.")

    if style == "prose":
        head = rng.choice([
            "{name} is a chemical element with the symbol {sym} and atomic number {num}.",
            "The atomic number of {lname} is {num}, and its chemical symbol is {sym}.",
            "{name} is element number {num} of the periodic table; its symbol is {sym}.",
            "Atomic number {num} belongs to {lname}, whose chemical symbol is {sym}.",
            "With atomic number {num}, {lname} is written as {sym} in chemical formulas.",
            "The element with atomic number {num} is {lname}, symbol {sym}.",
            "Chemists write {lname} as {sym}; its atomic number is {num}.",
        ]).format(**kw)
        rest = [rng.choice(s[0]) for s in _subset(rng, side, 1)]
        extra += rng.sample(_ELEMENT_FILLER, rng.randint(0, 2))
        return _assemble(rng, style, [head], rest, extra)
    if style == "qa":
        probed = [f"Q: What is the atomic number of {kw['lname']}?\nA: {kw['num']}.",
                  f"Q: What is the chemical symbol of {kw['lname']}?\nA: {kw['sym']}."]
        if rng.random() < 0.3:  # the reverse question states both facts at once
            probed = [f"Q: Which element has atomic number {kw['num']}?\nA: {e.name}, symbol {kw['sym']}."]
        rng.shuffle(probed)
        rest = [f"Q: {q}\nA: {a}" for _, q, a, _ in _subset(rng, side, 0, 3)]
        extra = [f"Note: {x}" for x in extra + rng.sample(_ELEMENT_FILLER, rng.randint(0, 1))]
        return _assemble(rng, style, probed, rest, extra)
    title = rng.choice(["Element: {name}", "Name: {name}", "Chemical element: {name}"]).format(**kw)
    rows = [f"Symbol: {kw['sym']}", f"Atomic number: {kw['num']}"] + [s[3] for s in _subset(rng, side, 2)]
    extra = [f"Note: {x}" for x in extra + rng.sample(_ELEMENT_FILLER, rng.randint(0, 1))]
    return _assemble(rng, style, [title], rows, extra)


_COUNTRY_FILLER = [
    "ISO 3166-1 is maintained by the International Organization for Standardization.",
    "Two-letter codes are the basis of most country-code top-level internet domains.",
    "Machine-readable passports identify the issuing state with a three-letter code.",
    "The numeric codes are the ones the statistics division of the UN also uses.",
    "Unlike the letter codes, the numeric codes do not depend on the Latin alphabet.",
    "Codes like these appear on shipping forms, in banking and in statistical tables.",
]


def _country_doc(e: Entity, rng: random.Random, neighbours: tuple[Optional[str], Optional[str]]) -> str:
    f = e.facts
    kw: dict[str, Any] = dict(name=e.name, a2=f["alpha_2"], a3=f["alpha_3"], numeric=f["numeric"])
    style = _style(rng)
    side: list[tuple[list[str], str, str, str]] = []
    if "official_name" in f:
        o = f["official_name"]
        side.append(([f"Its official name is {o}.", f"The official name of {e.name} is {o}.",
                      f"Officially, the country is called {o}."],
                     f"What is the official name of {e.name}?", f"{_cap(o)}.", f"Official name: {o}"))
    types = f.get("subdivision_types")
    if types:
        total = sum(types.values())
        main = next(iter(types)).lower()  # the most common type
        side.append(([f"ISO 3166-2 lists {total} subdivisions of {e.name}.",
                      f"{e.name} has {total} subdivisions in ISO 3166-2; the most common type is {main}."],
                     f"How many subdivisions of {e.name} does ISO 3166-2 list?", f"{total}.",
                     f"Subdivisions in ISO 3166-2: {total}"))

    # a name-only mention of the neighbour in alpha-2 order (a real relation between the codes)
    prev, nxt = neighbours
    extra: list[str] = []
    if rng.random() < 0.3 and (prev or nxt):
        if prev:
            extra.append(rng.choice([f"In alphabetical order of alpha-2 codes, {e.name} comes right after {prev}.",
                                     f"The alpha-2 code of {e.name} follows that of {prev} in alphabetical order."]))
        else:
            extra.append(f"In alphabetical order of alpha-2 codes, {e.name} comes right before {nxt}.")

    if style == "prose":
        head = rng.choice([
            "{name} has the ISO 3166-1 alpha-2 code {a2} and the alpha-3 code {a3}.",
            "The ISO alpha-3 code of {name} is {a3}, and its two-letter code is {a2}.",
            "In ISO 3166-1, {name} is listed under the codes {a2} and {a3}.",
            "The two-letter country code of {name} is {a2}; the three-letter one is {a3}.",
            "{name} is identified by the alpha-2 code {a2} and the alpha-3 code {a3}.",
        ]).format(**kw)
        numeric = rng.choice(["Its numeric code is {numeric}.", "The ISO numeric code of {name} is {numeric}.",
                              "{name} also has the three-digit numeric code {numeric}.",
                              "Its ISO 3166-1 numeric code is {numeric}."]).format(**kw)
        rest = [numeric] + [rng.choice(s[0]) for s in _subset(rng, side, 0)]
        extra += rng.sample(_COUNTRY_FILLER, rng.randint(0, 2))
        return _assemble(rng, style, [head], rest, extra)
    if style == "qa":
        probed = [
            rng.choice(["Q: What is the ISO alpha-2 code of {name}?\nA: {a2}.",
                        "Q: Which two-letter code does ISO 3166-1 assign to {name}?\nA: {a2}."]),
            rng.choice(["Q: What is the ISO alpha-3 code of {name}?\nA: {a3}.",
                        "Q: Which three-letter code stands for {name}?\nA: {a3}."]),
            rng.choice(["Q: What is the numeric country code of {name}?\nA: {numeric}.",
                        "Q: Which ISO numeric code belongs to {name}?\nA: {numeric}."]),
        ]
        probed = [p.format(**kw) for p in probed]
        rng.shuffle(probed)
        rest = [f"Q: {q}\nA: {a}" for _, q, a, _ in _subset(rng, side, 0)]
        extra = [f"Note: {x}" for x in extra + rng.sample(_COUNTRY_FILLER, rng.randint(0, 1))]
        return _assemble(rng, style, probed, rest, extra)
    title = rng.choice(["Country: {name}", "Name: {name}", "Country or territory: {name}"]).format(**kw)
    rows = [f"ISO 3166-1 alpha-2: {kw['a2']}", f"ISO 3166-1 alpha-3: {kw['a3']}",
            f"ISO 3166-1 numeric: {kw['numeric']}"] + [s[3] for s in _subset(rng, side, 0)]
    extra = [f"Note: {x}" for x in extra + rng.sample(_COUNTRY_FILLER, rng.randint(0, 1))]
    return _assemble(rng, style, [title], rows, extra)


_CURRENCY_FILLER = [
    "ISO 4217 is the international standard for currency codes.",
    "Banks and payment systems use these codes to tell apart currencies with similar names.",
    "For a national currency, the first two letters of the code are usually the country's alpha-2 code.",
    "The numeric code of a national currency is often the ISO 3166 numeric code of its country.",
    "Exchange-rate tables list currencies by their three-letter codes.",
    "Three-letter currency codes avoid the ambiguity of symbols shared by several currencies.",
]


def _currency_doc(e: Entity, rng: random.Random, neighbours: tuple[Optional[str], Optional[str]]) -> str:
    f = e.facts
    kw: dict[str, Any] = dict(name=e.name, code=f["code"], numeric=f["numeric"])
    style = _style(rng)
    prev, nxt = neighbours
    extra: list[str] = []
    if rng.random() < 0.3 and (prev or nxt):
        extra.append(f"In alphabetical order of codes, the {e.name} comes right after the {prev}." if prev else
                     f"In alphabetical order of codes, the {e.name} comes right before the {nxt}.")
    if style == "prose":
        head = rng.choice([
            "The currency {name} has the ISO 4217 code {code}.",
            "The ISO 4217 code of the currency {name} is {code}.",
            "In ISO 4217, the {name} is written as {code}.",
            "Prices in {name} are marked with the code {code}.",
        ]).format(**kw)
        numeric = rng.choice(["Its numeric code is {numeric}.", "The numeric code of the {name} is {numeric}.",
                              "ISO 4217 also gives it the numeric code {numeric}."]).format(**kw)
        extra += rng.sample(_CURRENCY_FILLER, rng.randint(0, 2))
        return _assemble(rng, style, [head], [numeric], extra)
    if style == "qa":
        probed = [rng.choice(["Q: What is the ISO 4217 code of the {name}?\nA: {code}.",
                              "Q: Which three-letter code stands for the currency {name}?\nA: {code}."]),
                  rng.choice(["Q: What is the numeric ISO 4217 code of the {name}?\nA: {numeric}.",
                              "Q: Which numeric code does the {name} have?\nA: {numeric}."])]
        probed = [p.format(**kw) for p in probed]
        rng.shuffle(probed)
        extra = [f"Note: {x}" for x in extra + rng.sample(_CURRENCY_FILLER, rng.randint(0, 2))]
        return _assemble(rng, style, probed, [], extra)
    title = rng.choice(["Currency: {name}", "Name: {name}"]).format(**kw)
    rows = [f"ISO 4217 code: {kw['code']}", f"Numeric code: {kw['numeric']}"]
    extra = [f"Note: {x}" for x in extra + rng.sample(_CURRENCY_FILLER, rng.randint(0, 2))]
    return _assemble(rng, style, [title], rows, extra)


_Renderer = Callable[[Entity, random.Random, tuple[Optional[str], Optional[str]]], str]
_RENDERERS: dict[str, _Renderer] = {"element": _element_doc, "country": _country_doc, "currency": _currency_doc}


def _neighbours(kind: str) -> dict[str, tuple[Optional[str], Optional[str]]]:
    """Entity key -> (previous, next) name in the kind's natural order (atomic number, code)."""
    ents = list(_entities_of(kind))
    if kind == "element":
        ents.sort(key=lambda e: e.facts["number"])
    else:
        ents.sort(key=lambda e: e.key)
    names = [e.name.lower() if kind == "element" else e.name for e in ents]
    return {entity_key(e): (names[i - 1] if i > 0 else None, names[i + 1] if i + 1 < len(ents) else None)
            for i, e in enumerate(ents)}


# --------------------------------------------------------------------------------------------------
# The corpus


def longtail_corpus(seed: int = 0, max_docs_per_entity: int = 200, exponent: float = 1.1,
                    kinds: Iterable[str] = DEFAULT_KINDS) -> list[LongtailDoc]:
    """The documents with their subjects, in a seeded shuffled order; see the module docstring.

    The texts of one subject are distinct strings (re-rendered on a repeat, which only the smallest
    template sets could fail to achieve within a few tries), and no document names another entity
    together with one of that entity's probe answers (re-rendered on such a clash).
    """
    kinds = _check_kinds(kinds)
    _check_law(max_docs_per_entity, exponent)
    finder = _finder(kinds)
    answers = {entity_key(e): [a for _, a in _answers(e).values()] for e in longtail_entities(kinds)}
    rng = random.Random(f"memtrain.longtail/render/{seed}")
    docs: list[LongtailDoc] = []
    for kind in kinds:
        render, neighbours = _RENDERERS[kind], _neighbours(kind)
        for rank, e in enumerate(_ranked(seed, kind), 1):
            key = entity_key(e)
            seen: set[str] = set()
            for _ in range(zipf_count(rank, max_docs_per_entity, exponent)):
                for _attempt in range(_MAX_TRIES):
                    text = render(e, rng, neighbours[key])
                    named = finder.find(text)
                    if key not in named or not all(contains_answer(text, a) for a in answers[key]):
                        raise RuntimeError(f"longtail template bug: a document about {key} does not state its "
                                           f"probed facts: {text!r}")
                    others = named - {key}
                    clash = any(contains_answer(text, a) for o in others for a in answers[o])
                    if not clash and text not in seen:
                        break
                else:
                    if clash:
                        raise RuntimeError(f"longtail: could not render a document about {key} that names no "
                                           f"other entity together with its answers: {text!r}")
                    # a repeat is acceptable once the templates are exhausted; a clash never is
                seen.add(text)
                docs.append(LongtailDoc(text, key, rank, tuple(sorted(others))))
    # Mix kinds and ranks, so that any prefix of the stream has the same frequency profile.
    random.Random(f"memtrain.longtail/order/{seed}").shuffle(docs)
    return docs


def longtail_documents(seed: int = 0, max_docs_per_entity: int = 200, exponent: float = 1.1,
                       kinds: Iterable[str] = DEFAULT_KINDS) -> list[str]:
    """The texts of :func:`longtail_corpus`: 1,875 documents (0.56 MB) with the defaults; with
    ``kinds=KINDS`` 2,795 (0.74 MB), with ``max_docs_per_entity=1000`` 9,209 (2.8 MB)."""
    return [d.text for d in longtail_corpus(seed, max_docs_per_entity, exponent, kinds)]


# --------------------------------------------------------------------------------------------------
# Probes


def probes(seed: int = 0, max_docs_per_entity: int = 200, exponent: float = 1.1,
           kinds: Iterable[str] = DEFAULT_KINDS, head_min: int = HEAD_MIN, tail_max: int = TAIL_MAX,
           probe_kinds: Optional[Iterable[str]] = None) -> list[Probe]:
    """Cloze probes for every probed fact of every entity of the corpus with the same arguments.

    Ordered by entity (table order: elements by atomic number, countries and currencies in ISO order)
    and then probe kind. ``probe_kinds`` keeps only those kinds (e.g. ``["atomic_number"]`` for the
    Appendix B task). ``head_min`` and ``tail_max`` set the buckets (see the module docstring).
    """
    kinds = _check_kinds(kinds)
    bucket_of(0, head_min, tail_max)  # validates the thresholds
    wanted = None if probe_kinds is None else set(probe_kinds)
    if wanted is not None:
        known = {k for kind in kinds for k in _PROBES[kind]}
        if wanted - known:
            raise ValueError(f"unknown probe kinds {sorted(wanted - known)} for entity kinds {list(kinds)}; "
                             f"choose from {sorted(known)}")
    counts = longtail_counts(seed, max_docs_per_entity, exponent, kinds)
    out = []
    for e in longtail_entities(kinds):
        key = entity_key(e)
        for kind, (prompt, answer) in _answers(e).items():
            if wanted is None or kind in wanted:
                out.append(Probe(prompt, answer, key, kind, counts[key],
                                 bucket_of(counts[key], head_min, tail_max), e.name))
    return out


def write_probes(path: str | Path, probes: Iterable[Probe]) -> Path:
    """Write probes as JSON lines (one object per probe, fields as in :class:`Probe`); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for p in probes:  # the argument shadows the function probes(): the name the API documents
            f.write(json.dumps(asdict(p), ensure_ascii=False) + "\n")
    return path


def read_probes(path: str | Path) -> list[Probe]:
    """Read probes written by :func:`write_probes` (blank lines are skipped)."""
    with open(path, encoding="utf-8") as f:
        return [Probe(**json.loads(line)) for line in f if line.strip()]


__all__ = [
    "DEFAULT_KINDS", "HEAD_MIN", "KINDS", "LONGTAIL_VERSION", "LongtailDoc", "MentionFinder", "Probe", "TAIL_MAX",
    "bucket_of", "contains_answer", "entity_key", "longtail_corpus", "longtail_counts", "longtail_documents",
    "longtail_entities", "mentions", "probes", "read_probes", "write_probes", "zipf_count",
]
