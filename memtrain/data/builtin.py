"""The built-in corpus: short factual documents generated from fact tables of installed packages.

The quickstart must train without downloading anything, so memtrain ships a corpus generated from
real reference data that Python packages already carry: ``periodictable`` (chemical elements) and
``pycountry`` (ISO 3166 countries and subdivisions, ISO 4217 currencies, ISO 639 languages).

Generation has two layers so that later corpora (e.g. a Zipf-frequency long-tail knowledge corpus)
can reuse the first one:

* fact functions (:func:`element_facts`, :func:`country_facts`, :func:`historic_country_facts`,
  :func:`subdivision_facts`, :func:`currency_facts`, :func:`language_facts`, :func:`all_entities`)
  return :class:`Entity` records holding the real values, in the packages' own order;
* :func:`render` turns one record into a short document, choosing among several sentence templates
  with a caller-supplied random generator; :func:`builtin_documents` renders every record twice.

Output is a pure function of the seed and the installed package versions.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

# Bump when templates or record selection change, so prepared data that used "builtin" is rebuilt.
BUILTIN_VERSION = 1


@dataclass(frozen=True)
class Entity:
    """One thing the corpus states facts about; ``facts`` maps attribute names to real values."""

    kind: str  # "element", "country", "historic_country", "subdivision", "currency" or "language"
    key: str  # unique within kind: a chemical symbol or an ISO code
    name: str
    facts: dict[str, Any] = field(default_factory=dict, hash=False)


# --------------------------------------------------------------------------------------------------
# Fact tables

# periodictable's crystal symmetry labels -> words
_CRYSTALS = {"BCC": "body-centred cubic", "fcc": "face-centred cubic", "hcp": "hexagonal close-packed",
             "SC": "simple cubic", "Diamond": "diamond cubic", "Cubic": "cubic", "Tetragonal": "tetragonal",
             "Orthorhombic": "orthorhombic", "Rhombohedral": "rhombohedral", "Monoclinic": "monoclinic"}


def element_facts() -> list[Entity]:
    """Chemical elements 1..118 from ``periodictable``: symbol, atomic number, mass, density, covalent
    radius, crystal structure, known isotopes and natural isotopic abundances, where the tables have them."""
    import periodictable

    out = []
    for el in periodictable.elements:
        if el.number < 1:  # element 0 is the free neutron, not a chemical element
            continue
        facts: dict[str, Any] = {"symbol": el.symbol, "number": el.number}
        if el.mass:
            facts["mass"] = float(el.mass)
        if el.density:
            facts["density"] = float(el.density)
            # gases are given as liquids at their boiling point, e.g. caveat "T=-252.87" (Celsius)
            m = re.match(r"T=(-?\d+(?:\.\d+)?)", getattr(el, "density_caveat", "") or "")
            if m:
                facts["density_celsius"] = float(m.group(1))
        # some attributes exist only for elements the tables cover
        if getattr(el, "covalent_radius", None):
            facts["covalent_radius"] = float(el.covalent_radius)  # angstrom
        symmetry = (getattr(el, "crystal_structure", None) or {}).get("symmetry")
        if symmetry in _CRYSTALS:  # skips "atom"/"diatom", which describe gases, not crystals
            facts["crystal_structure"] = _CRYSTALS[symmetry]
        isotopes = [iso.isotope for iso in el]
        if isotopes:
            facts["isotopes"] = (len(isotopes), min(isotopes), max(isotopes))
        natural = [(iso.isotope, float(iso.abundance)) for iso in el if iso.abundance and iso.abundance > 0]
        if natural:
            facts["natural_isotopes"] = natural  # (mass number, abundance in percent)
        out.append(Entity("element", el.symbol, el.name.capitalize(), facts))
    return out


def country_facts() -> list[Entity]:
    """ISO 3166-1 countries from ``pycountry`` with codes, official name and subdivision counts."""
    import pycountry

    by_country: dict[str, Counter] = {}
    top_level: dict[str, list[str]] = {}
    for sub in pycountry.subdivisions:
        by_country.setdefault(sub.country_code, Counter())[sub.type] += 1
        if not sub.parent_code:
            top_level.setdefault(sub.country_code, []).append(sub.name)
    out = []
    for c in pycountry.countries:
        facts: dict[str, Any] = {"alpha_2": c.alpha_2, "alpha_3": c.alpha_3, "numeric": c.numeric}
        official = getattr(c, "official_name", None)
        if official and official != c.name:
            facts["official_name"] = official
        types = by_country.get(c.alpha_2)
        if types:
            facts["subdivision_types"] = dict(sorted(types.items(), key=lambda kv: (-kv[1], kv[0])))
            facts["top_subdivisions"] = top_level.get(c.alpha_2, [])
        out.append(Entity("country", c.alpha_2, c.name, facts))
    return out


def historic_country_facts() -> list[Entity]:
    """Withdrawn ISO 3166-3 country codes from ``pycountry``: former codes and withdrawal year."""
    import pycountry

    out = []
    for c in pycountry.historic_countries:
        facts = {"alpha_2": c.alpha_2, "alpha_3": c.alpha_3, "alpha_4": c.alpha_4,
                 "numeric": getattr(c, "numeric", None), "withdrawn": getattr(c, "withdrawal_date", None)}
        out.append(Entity("historic_country", c.alpha_4, c.name, facts))
    return out


def subdivision_facts() -> list[Entity]:
    """ISO 3166-2 subdivisions from ``pycountry``: code, type, country and parent subdivision."""
    import pycountry

    countries = {c.alpha_2: c.name for c in pycountry.countries}
    names = {s.code: s.name for s in pycountry.subdivisions}
    out = []
    for s in pycountry.subdivisions:
        facts: dict[str, Any] = {"code": s.code, "type": s.type, "country": countries.get(s.country_code)}
        if s.parent_code:
            # pycountry stores some parent codes without the country prefix
            parent = s.parent_code if "-" in s.parent_code else f"{s.country_code}-{s.parent_code}"
            if parent in names:
                facts["parent"] = names[parent]
        if facts["country"]:
            out.append(Entity("subdivision", s.code, s.name, facts))
    return out


def currency_facts() -> list[Entity]:
    """ISO 4217 currencies from ``pycountry``: alphabetic and numeric codes."""
    import pycountry

    return [
        Entity("currency", c.alpha_3, c.name, {"code": c.alpha_3, "numeric": getattr(c, "numeric", None)})
        for c in pycountry.currencies
    ]


_LANGUAGE_TYPES = {"L": "living", "E": "extinct", "A": "ancient", "H": "historical", "C": "constructed"}
_LANGUAGE_SCOPES = {"I": "individual language", "M": "macrolanguage"}


def language_facts() -> list[Entity]:
    """ISO 639 languages from ``pycountry`` that have a two-letter ISO 639-1 code (about 180)."""
    import pycountry

    out = []
    for lang in pycountry.languages:
        alpha_2 = getattr(lang, "alpha_2", None)
        if not alpha_2:
            continue
        facts: dict[str, Any] = {"alpha_2": alpha_2, "alpha_3": lang.alpha_3}
        if getattr(lang, "bibliographic", None):
            facts["bibliographic"] = lang.bibliographic
        if _LANGUAGE_TYPES.get(getattr(lang, "type", "")):
            facts["status"] = _LANGUAGE_TYPES[lang.type]
        if _LANGUAGE_SCOPES.get(getattr(lang, "scope", "")):
            facts["scope"] = _LANGUAGE_SCOPES[lang.scope]
        out.append(Entity("language", lang.alpha_3, lang.name, facts))
    return out


def all_entities() -> list[Entity]:
    """Every record of every fact table, grouped by kind in a fixed order."""
    return (element_facts() + country_facts() + historic_country_facts() + subdivision_facts()
            + currency_facts() + language_facts())


# --------------------------------------------------------------------------------------------------
# Templates: each fact has several phrasings; a document opens with an identifying sentence and
# states the remaining facts in random order, so the model sees each fact in varied contexts.


def _num(x: float) -> str:
    return f"{x:.6g}"


def _a(word: str) -> str:
    return ("an " if word[:1].lower() in "aeiou" else "a ") + word


def _join(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def _pick(rng: random.Random, options: list[str], **kw: Any) -> str:
    return rng.choice(options).format(**kw)


def _element(e: Entity, rng: random.Random) -> str:
    f = e.facts
    kw = dict(name=e.name, lname=e.name.lower(), sym=f["symbol"], num=f["number"])
    head = _pick(rng, [
        "{name} is a chemical element with the symbol {sym} and atomic number {num}.",
        "The element {lname}, symbol {sym}, has atomic number {num}.",
        "{name} ({sym}) is the element with atomic number {num} in the periodic table.",
        "Atomic number {num} belongs to {lname}, whose chemical symbol is {sym}.",
        "With atomic number {num}, {lname} is written {sym} in chemical formulas.",
    ], **kw)
    rest = []
    if "mass" in f:
        rest.append(_pick(rng, [
            "Its atomic mass is listed as {mass}.",
            "An atom of {lname} has a mass of about {mass} daltons.",
            "The atomic mass of {lname} is {mass} u.",
            "{name} has a relative atomic mass of {mass}.",
        ], mass=_num(f["mass"]), **kw))
    if "density" in f:
        at = f" at {_num(f['density_celsius'])} °C" if "density_celsius" in f else ""
        rest.append(_pick(rng, [
            "Its density is {d} g/cm3{at}.",
            "{name} has a density of {d} grams per cubic centimetre{at}.",
            "The density of {lname} is about {d} g/cm3{at}.",
        ], d=_num(f["density"]), at=at, **kw))
    if "covalent_radius" in f:
        rest.append(_pick(rng, [
            "Its covalent radius is {r} angstroms.",
            "The covalent radius of {lname} is about {r} Å.",
        ], r=_num(f["covalent_radius"]), **kw))
    if "crystal_structure" in f:
        rest.append(_pick(rng, [
            "Solid {lname} has a {cs} crystal structure.",
            "{name} crystallises in the {cs} structure.",
        ], cs=f["crystal_structure"], **kw))
    if "isotopes" in f:
        n, lo, hi = f["isotopes"]
        rest.append(_pick(rng, [
            "{n} isotopes of {lname} are known, with mass numbers from {lo} to {hi}.",
            "Known isotopes of {lname} range from {lname}-{lo} to {lname}-{hi} ({n} in total).",
        ], n=n, lo=lo, hi=hi, **kw))
    if "natural_isotopes" in f:
        parts = [f"{e.name.lower()}-{a} ({_num(p)}%)" for a, p in f["natural_isotopes"]]
        rest.append(_pick(rng, [
            "Its naturally occurring isotopes are {iso}.",
            "Natural {lname} consists of {iso}.",
            "The natural isotopic composition of {lname} is {iso}.",
        ], iso=_join(parts), **kw))
    rest.append(_pick(rng, [
        "The symbol {sym} stands for {lname}.",
        "{sym} is element number {num}.",
        "In the periodic table, {lname} sits at position {num}.",
    ], **kw))
    rng.shuffle(rest)
    return " ".join([head] + rest)


def _country(e: Entity, rng: random.Random) -> str:
    f = e.facts
    kw = dict(name=e.name, a2=f["alpha_2"], a3=f["alpha_3"], numeric=f["numeric"])
    head = _pick(rng, [
        "{name} is a country with the ISO 3166-1 alpha-2 code {a2} and alpha-3 code {a3}.",
        "The ISO 3166 country code of {name} is {a2}; its three-letter code is {a3}.",
        "{name} ({a3}) is identified by the two-letter code {a2} in ISO 3166-1.",
        "In ISO 3166-1, {name} has the codes {a2} and {a3}.",
    ], **kw)
    rest = [_pick(rng, [
        "Its numeric country code is {numeric}.",
        "The ISO 3166-1 numeric code of {name} is {numeric}.",
        "{name} uses the numeric code {numeric}.",
    ], **kw)]
    if "official_name" in f:
        rest.append(_pick(rng, [
            "Its official name is {official}.",
            "The official name of {name} is {official}.",
            "Officially, the country is called {official}.",
        ], official=f["official_name"], **kw))
    types = f.get("subdivision_types")
    if types:
        total = sum(types.values())
        listing = _join([f"{n} of type {t.lower()}" for t, n in types.items()])
        rest.append(_pick(rng, [
            "ISO 3166-2 lists {total} subdivisions of {name}: {listing}.",
            "{name} has {total} subdivisions in ISO 3166-2, {listing}.",
        ], total=total, listing=listing, **kw))
        top = f.get("top_subdivisions") or []
        if 1 < len(top) <= 40:
            rest.append(_pick(rng, [
                "Its top-level subdivisions are {subs}.",
                "{name} is divided into {subs}.",
            ], subs=_join(top), **kw))
    rng.shuffle(rest)
    return " ".join([head] + rest)


def _subdivision(e: Entity, rng: random.Random) -> str:
    f = e.facts
    kw = dict(name=e.name, code=f["code"], country=f["country"], a_type=_a(f["type"].lower()),
              type=f["type"].lower())
    head = _pick(rng, [
        "{name} is {a_type} of {country}; its ISO 3166-2 code is {code}.",
        "The ISO 3166-2 code {code} refers to {name}, {a_type} in {country}.",
        "{name} ({code}) is {a_type} of {country}.",
        "In {country}, {name} is {a_type} with the code {code}.",
    ], **kw)
    rest = []
    if "parent" in f:
        rest.append(_pick(rng, [
            "It is part of {parent}.",
            "{name} lies within {parent}.",
            "Its parent subdivision is {parent}.",
        ], parent=f["parent"], **kw))
    rest.append(_pick(rng, [
        "The code {code} begins with the country code of {country}.",
        "Its subdivision type is {type}.",
        "{name} belongs to {country}.",
    ], **kw))
    rng.shuffle(rest)
    return " ".join([head] + rest)


def _currency(e: Entity, rng: random.Random) -> str:
    f = e.facts
    kw = dict(name=e.name, code=f["code"], numeric=f["numeric"])
    head = _pick(rng, [
        "The currency {name} has the ISO 4217 code {code}.",
        "{code} is the ISO 4217 code of the currency {name}.",
        "In ISO 4217, the {name} is written {code}.",
    ], **kw)
    rest = []
    if f["numeric"]:
        rest.append(_pick(rng, [
            "Its numeric currency code is {numeric}.",
            "The numeric code of the {name} is {numeric}.",
        ], **kw))
    return " ".join([head] + rest)


def _language(e: Entity, rng: random.Random) -> str:
    f = e.facts
    kw = dict(name=e.name, a2=f["alpha_2"], a3=f["alpha_3"])
    head = _pick(rng, [
        "{name} has the ISO 639-1 code {a2} and the ISO 639-3 code {a3}.",
        "The language code {a2} stands for {name}.",
        "In ISO 639, {name} is identified by {a2} and {a3}.",
    ], **kw)
    rest = []
    if "status" in f or "scope" in f:
        what = " ".join(x for x in (f.get("status"), f.get("scope", "language")) if x)
        rest.append(_pick(rng, [
            "{name} is {what}.",
            "ISO 639-3 classifies {name} as {what}.",
        ], what=_a(what), **kw))
    if "bibliographic" in f:
        rest.append(_pick(rng, [
            "Its bibliographic code is {b}.",
            "Libraries catalogue {name} under the code {b}.",
        ], b=f["bibliographic"], **kw))
    if "a2" not in head:
        rest.append(f"Its three-letter code is {f['alpha_3']}.")
    rng.shuffle(rest)
    return " ".join([head] + rest)


def _historic_country(e: Entity, rng: random.Random) -> str:
    f = e.facts
    kw = dict(name=e.name, a2=f["alpha_2"], a3=f["alpha_3"], a4=f["alpha_4"], year=f["withdrawn"])
    head = _pick(rng, [
        "{name} was a country with the ISO 3166-1 codes {a2} and {a3}.",
        "The former country {name} used the ISO codes {a2} and {a3}.",
    ], **kw)
    rest = [_pick(rng, [
        "Its ISO 3166-3 code is {a4}.",
        "ISO 3166-3 records {name} under the four-letter code {a4}.",
    ], **kw)]
    if f["withdrawn"]:
        rest.append(_pick(rng, [
            "Its codes were withdrawn in {year}.",
            "The code {a3} was withdrawn from ISO 3166-1 in {year}.",
        ], **kw))
    if f["numeric"]:
        rest.append(f"Its numeric code was {f['numeric']}.")
    rng.shuffle(rest)
    return " ".join([head] + rest)


_RENDERERS: dict[str, Callable[[Entity, random.Random], str]] = {
    "element": _element, "country": _country, "historic_country": _historic_country, "subdivision": _subdivision,
    "currency": _currency, "language": _language,
}


def render(entity: Entity, rng: random.Random) -> str:
    """One short document stating every fact of ``entity`` with randomly chosen phrasings."""
    return _RENDERERS[entity.kind](entity, rng)


def builtin_documents(seed: int = 0, entities: Optional[list[Entity]] = None, copies: int = 2) -> list[str]:
    """Every entity rendered ``copies`` times with independently drawn phrasings, deterministic in ``seed``.

    With the defaults: about 11,600 documents, 1.5 MB of text. Restating each fact in different
    words is what lets a language model store it as knowledge rather than memorise one string.
    Documents come as copy 1 of every entity, then copy 2, ...; callers shuffle if they need mixing.
    """
    rng = random.Random(seed)
    entities = entities if entities is not None else all_entities()
    return [render(e, rng) for _ in range(copies) for e in entities]


__all__ = [
    "BUILTIN_VERSION", "Entity", "all_entities", "builtin_documents", "country_facts", "currency_facts",
    "element_facts", "historic_country_facts", "language_facts", "render", "subdivision_facts",
]
