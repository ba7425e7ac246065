"""Tests of the long-tail knowledge corpus and its probes (memtrain.data.longtail; CPU, a few seconds)."""

from __future__ import annotations

import json
import re
import time
from collections import Counter, defaultdict

import pytest

from memtrain.data import longtail as lt
from memtrain.data.longtail import (
    KINDS, Probe, bucket_of, longtail_corpus, longtail_counts, longtail_documents, longtail_entities, probes,
    read_probes, write_probes, zipf_count,
)
from memtrain.data.sources import ReadStats, read_documents
from memtrain.errors import DataError


@pytest.fixture(scope="module")
def corpus() -> list[lt.LongtailDoc]:
    return longtail_corpus(0)


def _mention_index(texts: list[str], kinds) -> dict[str, list[int]]:
    """Entity key -> indices of the texts naming it, computed independently of the module's finder:
    one regex alternation, longest names first, so "Guinea" inside "Papua New Guinea" is not Guinea."""
    ents = sorted(longtail_entities(kinds), key=lambda e: -len(e.name))
    alts = [f"(?i:{re.escape(e.name)})" if e.kind == "element" else re.escape(e.name) for e in ents]
    pattern = re.compile(r"(?<!\w)(?:" + "|".join(alts) + r")(?!\w)")
    by_name = {(e.name.lower() if e.kind == "element" else e.name): lt.entity_key(e) for e in ents}
    index: dict[str, list[int]] = defaultdict(list)
    for i, text in enumerate(texts):
        keys = {by_name.get(m.group()) or by_name[m.group().lower()] for m in pattern.finditer(text)}
        for key in keys:
            index[key].append(i)
    return index


def _has_answer(text: str, answer: str) -> bool:
    # the answer string verbatim, not continued by a letter, digit or decimal part (" 26" is not " 263")
    return re.search(re.escape(answer) + r"(?!\w|\.\d)", text) is not None


def test_deterministic_fast_and_small():
    lt._entities_of.cache_clear()  # time a cold start, fact tables included
    lt._finder.cache_clear()
    start = time.perf_counter()
    docs = longtail_documents(0)
    elapsed = time.perf_counter() - start
    assert elapsed < 3.0, f"generation took {elapsed:.2f} s"
    assert docs == longtail_documents(0)
    assert docs != longtail_documents(1)
    assert len(docs) == sum(longtail_counts(0).values())
    size = sum(len(d.encode()) for d in docs)
    assert 300_000 < size < 5_000_000
    # the corpus is shuffled: kinds are mixed from the start
    assert {d.entity.split(":")[0] for d in longtail_corpus(0)[:50]} == {"element", "country"}


def test_zipf_shape(corpus):
    counts = longtail_counts(0)
    assert Counter(d.entity for d in corpus) == counts
    for kind in ("element", "country"):
        ranked = [c for key, c in counts.items() if key.startswith(kind + ":")]  # rank order
        assert ranked == sorted(ranked, reverse=True)
        assert ranked == [zipf_count(r) for r in range(1, len(ranked) + 1)]
        assert ranked[0] == 200 and ranked[-1] == 1
        assert ranked[0] >= 50 * ranked[-1]
        assert ranked[1] == round(200 * 2 ** -1.1)
    assert len([k for k in counts if k.startswith("element:")]) == 118
    # the law is configurable
    flat = longtail_counts(0, max_docs_per_entity=10, exponent=1.0)
    assert list(flat.values())[:4] == [10, 5, 3, 2]  # elements come first, in rank order
    # frequency is a seeded permutation, not atomic order: rank vs atomic number is uncorrelated
    numbers = {lt.entity_key(e): e.facts["number"] for e in longtail_entities(["element"])}
    order = [numbers[k] for k in counts if k.startswith("element:")]
    n = len(order)
    rho = 1 - 6 * sum((r - (a - 1)) ** 2 for r, a in enumerate(order)) / (n * (n * n - 1))
    assert abs(rho) < 0.3
    assert list(longtail_counts(1)) != list(counts)


def test_facts_are_real(corpus):
    by = {(p.name, p.kind): p for p in probes(0)}
    iron = by["Iron", "atomic_number"]
    assert (iron.prompt, iron.answer, iron.entity) == ("The atomic number of Iron is", " 26", "element:Fe")
    assert by["Iron", "symbol"].answer == " Fe"
    assert by["Fermium", "atomic_number"].answer == " 100"
    germany = by["Germany", "alpha_3"]
    assert (germany.prompt, germany.answer, germany.entity) == ("The ISO alpha-3 code of Germany is", " DEU",
                                                                 "country:DE")
    assert by["Germany", "alpha_2"].answer == " DE" and by["Germany", "numeric"].answer == " 276"
    assert by["South Korea", "alpha_3"].answer == " KOR"  # readable names, not "Korea, Republic of"
    assert by["British Virgin Islands", "alpha_2"].answer == " VG"
    assert by["Afghanistan", "numeric"].answer == " 004"  # numeric codes keep their leading zeros
    iron_docs = [d.text for d in corpus if d.entity == "element:Fe"]
    assert len(iron_docs) == iron.count and all(" 26" in t and " Fe" in t for t in iron_docs)
    assert all("55.845" in t for t in iron_docs if "atomic mass" in t.lower())
    assert any("atomic mass" in t.lower() for t in iron_docs)
    # no invented facts: periodictable ships no discovery data
    assert not any(re.search(r"discover", d.text, re.I) for d in corpus)


@pytest.mark.parametrize("seed,kinds", [(0, ("element", "country")), (1, KINDS)])
def test_every_probe_is_stated_exactly_count_times(seed, kinds):
    """For every probe: the documents that name the entity and contain the answer number exactly
    ``count``, and each of the entity's own documents contains the answer verbatim."""
    corpus = longtail_corpus(seed, kinds=kinds)
    texts = [d.text for d in corpus]
    index = _mention_index(texts, kinds)
    own = defaultdict(list)
    for i, d in enumerate(corpus):
        own[d.entity].append(i)
    ps = probes(seed, kinds=kinds)
    assert {p.entity for p in ps} == set(longtail_counts(seed, kinds=kinds))
    for p in ps:
        stating = [i for i in index[p.entity] if _has_answer(texts[i], p.answer)]
        assert len(stating) == p.count, (p, [texts[i] for i in stating if corpus[i].entity != p.entity][:2])
        assert sorted(stating) == own[p.entity]
        assert all(p.answer in texts[i] for i in own[p.entity])
        assert p.bucket == ("head" if p.count >= 50 else "tail" if p.count <= 4 else "torso")
    buckets = Counter(p.bucket for p in ps if p.kind == ps[0].kind)
    assert set(buckets) == {"head", "torso", "tail"}


def test_documents_vary(corpus):
    per = defaultdict(list)
    for d in corpus:
        per[d.entity].append(d.text)
    for key, texts in per.items():
        assert len(set(texts)) == len(texts), key  # repetitions are separately rendered, never copies
    head = max(per, key=lambda k: len(per[k]))
    texts = per[head]
    assert any(t.startswith("Q: ") for t in texts) and any(": " in t.split("\n")[0] and "\n" in t
                                                           and not t.startswith("Q: ") for t in texts)
    assert len({t.split(".")[0] for t in texts if "\n" not in t}) >= 5  # several opening templates
    # some documents name a related entity (a neighbour), never with that entity's answers
    assert any(d.mentions for d in corpus)


def test_buckets_are_parameters():
    ps = probes(0, head_min=100, tail_max=1, probe_kinds=["atomic_number"])
    assert len(ps) == 118 and {p.kind for p in ps} == {"atomic_number"}
    assert [p.name for p in ps[:3]] == ["Hydrogen", "Helium", "Lithium"]
    for p in ps:
        assert p.bucket == bucket_of(p.count, 100, 1)
    assert Counter(p.bucket for p in ps)["head"] == 1  # ranks 1 and 2 have 200 and 93 documents
    assert bucket_of(50) == "head" and bucket_of(49) == "torso" and bucket_of(5) == "torso"
    assert bucket_of(4) == "tail" and bucket_of(1) == "tail"
    with pytest.raises(ValueError, match="head_min"):
        probes(0, head_min=4, tail_max=4)
    with pytest.raises(ValueError, match="unknown probe kinds"):
        probes(0, probe_kinds=["currency_code"])
    with pytest.raises(ValueError, match="unknown entity kind"):
        longtail_counts(0, kinds=["planet"])
    with pytest.raises(ValueError, match="max_docs_per_entity"):
        longtail_documents(0, max_docs_per_entity=0)
    with pytest.raises(ValueError, match="exponent"):
        longtail_documents(0, exponent=0)


def test_read_documents_builtin_longtail():
    stats = ReadStats()
    assert list(read_documents(["builtin:longtail"], stats=stats)) == longtail_documents(0)
    assert stats.files == ["builtin:longtail"] and stats.documents == len(longtail_documents(0))
    with pytest.raises(DataError, match="unknown built-in corpus 'builtin:nope'"):
        list(read_documents(["builtin:nope"]))


def test_probes_jsonl_roundtrip(tmp_path):
    ps = probes(0, kinds=KINDS)
    path = write_probes(tmp_path / "sub" / "probes.jsonl", ps)
    assert read_probes(path) == ps
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == len(ps)
    first = json.loads(lines[0])
    assert set(first) == {"prompt", "answer", "entity", "kind", "count", "bucket", "name"}
    assert Probe(**first) == ps[0]
    assert any("currency" in p.kind for p in ps)
