"""Citations of the contract resolve. Code, tests and docs cite docs/contract.md by section
(``(contract 4.5)``, ``contract 3, 4.5``, ``docs/contract.md section 6``) and by invariant
(``contract 8, invariant 7``): each one must name a section, or an invariant of section 8,
that the contract has, and none may cite the product specification the repository was
first written against, which lives outside it. The contract's fleet-file table must list
every key of the fleet file's structs with the default the structs give, and no key they
lack."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from tests.support.fleet_keys import fleet_fields
from tests.support.paths import ROOT

CONTRACT = ROOT / "docs" / "contract.md"
# where citations live: the product, its docs, and everything that tests or deploys it
TREES = ("narwhal", "docs", "e2e", "bench", "deploy", "tests", "fuzz", "examples")
TOP_FILES = ("README.md", "Makefile")
TEXT_SUFFIXES = frozenset({".py", ".md", ".txt", ".toml", ".yaml", ".yml", ".sh", ".service"})
TEXT_NAMES = frozenset({"Containerfile"})
SKIPPED_DIRS = frozenset({"__pycache__", ".venv", "build"})

_NUMBER = r"\d+(?:\.\d+)?"
_MORE = r"(?:\s*,\s*|\s+and\s+|\s+to\s+)"
# the word that cites the contract, then one number or a list of them ("3, 4.5",
# "4.1 to 4.3", "sections 3 and 6"); a line break may fall anywhere in between
CITATION = re.compile(rf"\bcontract(?:\.md)?\s+(?:sections?\s+)?({_NUMBER}(?:{_MORE}{_NUMBER})*)\b")
# the outside specification's citations, in every form the code once used (a section, its
# invariants, its name, a table column); the commit that rewrote them says how to again
OLD_CITATION = re.compile(
    r"\bSPEC\s+(?:\d|sections?\b|invariants?\b)|\bSPEC[']s\b|(?<![\"'])\bSPEC\.md\b"
    r"|\|\s*SPEC\s*\|"
)
INVARIANT = re.compile(r"\binvariants?\s+(\d+(?:(?:\s*,\s*|\s+and\s+)\d+)*)\b")
HEADING = re.compile(rf"^#{{2,4}}\s+({_NUMBER})\.?\s", re.MULTILINE)
KEY_ROW = re.compile(r"^\| `([\w.]+)` \| [^|]+ \| ([^|]+) \|", re.MULTILINE)


def _text_files() -> Iterator[Path]:
    for name in TOP_FILES:
        yield ROOT / name
    for tree in TREES:
        for path in sorted((ROOT / tree).rglob("*")):
            if SKIPPED_DIRS.intersection(path.relative_to(ROOT).parts) or not path.is_file():
                continue
            if path.suffix in TEXT_SUFFIXES or path.name in TEXT_NAMES:
                yield path


def _citations(pattern: re.Pattern[str]) -> Iterator[tuple[str, str]]:
    """(``file:line``, cited number) for every number ``pattern`` finds, in every file."""
    for path in _text_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for match in pattern.finditer(text):
            where = f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, match.start()) + 1}"
            for number in re.findall(_NUMBER, match.group(1)):
                yield where, number


def _sections() -> set[str]:
    return set(HEADING.findall(CONTRACT.read_text()))


def _section(number: int) -> str:
    """The text of top-level section ``number``, up to the next."""
    text = CONTRACT.read_text()
    return text[text.index(f"\n## {number}. ") : text.index(f"\n## {number + 1}. ")]


def _invariants() -> set[str]:
    """The numbers of section 8's list."""
    return set(re.findall(r"^(\d+)\. ", _section(8), re.MULTILINE))


def test_the_contract_has_every_section_the_code_was_written_against() -> None:
    expected = {str(n) for n in range(1, 10)}
    expected |= {f"4.{n}" for n in range(1, 9)} | {f"6.{n}" for n in range(1, 5)}
    assert _sections() == expected
    assert _invariants() == {str(n) for n in range(1, 14)}


def test_the_citations_are_found() -> None:
    """The patterns find what they must, so a test that finds nothing proves nothing."""
    found = [number for _, number in _citations(CITATION)]
    assert len(found) > 150
    text = "(contract 3, 4.5), contract\n4.1 to 4.3, docs/contract.md section 6, engine_contract 2"
    assert [m.group(1) for m in CITATION.finditer(text)] == ["3, 4.5", "4.1 to 4.3", "6"]
    assert INVARIANT.findall("(contract 8, invariants 9 and 10)") == ["9 and 10"]
    old = "SPEC"  # the forms are built here: neither this test nor the rewrite finds them
    forms = (
        f"({old} 4.5)",
        f"{old} sections 3",
        f"the {old}'s commit",
        f"of {old}.md",
        f"| {old} |",
    )
    assert all(OLD_CITATION.search(form) for form in forms)
    assert not OLD_CITATION.search(f'assert "{old}.md" not in text')  # the docs' own check


def test_every_cited_section_exists() -> None:
    sections = _sections()
    missing = [f"{where}: {number}" for where, number in _citations(CITATION)]
    missing = [line for line in missing if line.rsplit(": ", 1)[1] not in sections]
    assert not missing, "docs/contract.md has no such section:\n" + "\n".join(missing)


def test_no_citation_of_the_outside_specification_is_left() -> None:
    left = []
    for path in _text_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for match in OLD_CITATION.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            left.append(f"{path.relative_to(ROOT)}:{line}: {match.group(0)}")
    assert not left, "cite docs/contract.md instead:\n" + "\n".join(left)


def test_every_cited_invariant_exists() -> None:
    invariants = _invariants()
    missing = [
        f"{where}: invariant {number}"
        for where, number in _citations(INVARIANT)
        if number not in invariants
    ]
    assert not missing, "docs/contract.md section 8 has no such invariant:\n" + "\n".join(missing)


def _default(field: msgspec.inspect.Field) -> str:
    """A key's default as the contract's table writes it."""
    if field.required:
        return "required"
    value = field.default
    if value is msgspec.NODEFAULT:  # a mutable default: made by its factory
        value = field.default_factory()
    if value is None:
        return "unset"
    if isinstance(value, dict):
        return "none"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{value!r}`"


def test_the_fleet_file_table_holds_every_key_with_its_default() -> None:
    found = KEY_ROW.findall(_section(2))
    rows = {key: default.strip() for key, default in found}
    fields = dict(fleet_fields())
    assert len(rows) == len(found)  # one row per key
    assert rows.keys() == fields.keys()
    for key, field in fields.items():
        assert field is not None
        assert rows[key] == _default(field), key


@pytest.mark.parametrize("doc", ["README.md", "docs/architecture.md"])
def test_the_contract_is_listed_with_the_docs(doc: str) -> None:
    assert "docs/contract.md" in (ROOT / doc).read_text()
