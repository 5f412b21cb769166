"""The repository's docs stand on their own: every key of the fleet file's structs is
described in docs/operator-guide.md and shown in examples/fleet.toml, and neither the
README nor the example points at a file outside the repository."""

from __future__ import annotations

import re

import pytest

from tests.support.fleet_keys import fleet_keys
from tests.support.paths import ROOT

GUIDE = ROOT / "docs" / "operator-guide.md"
EXAMPLE = ROOT / "examples" / "fleet.toml"
# keys deliberately not in examples/fleet.toml, each with the reason (none at present)
ABSENT_FROM_EXAMPLE: dict[str, str] = {}
KEYS = fleet_keys()


def _example_keys() -> set[str]:
    """``section.key`` of every line of the example that sets a key, commented out or not."""
    found, section = set(), ""
    for line in EXAMPLE.read_text().splitlines():
        if header := re.match(r"\s*#?\s*\[\[?([\w.]+)\]\]?", line):
            section = header.group(1)
        elif key := re.match(r"\s*#?\s*(\w+)\s*=", line):
            found.add(f"{section}.{key.group(1)}" if section else key.group(1))
    return found


def test_the_keys_are_found() -> None:
    assert {"model", "engines.id", "serving.request_timeout_s", "engine.kv_lease_s"} <= set(KEYS)
    assert "engine_contract.kv_lease_s" in KEYS
    assert "engine.reclaim_orphans" in KEYS


@pytest.mark.parametrize("key", KEYS)
def test_every_key_is_described_in_the_operator_guide(key: str) -> None:
    assert f"| `{key}` |" in GUIDE.read_text(), f"docs/operator-guide.md section 10 lacks {key}"


@pytest.mark.parametrize("key", KEYS)
def test_every_key_is_in_the_example(key: str) -> None:
    if key in ABSENT_FROM_EXAMPLE:
        pytest.skip(ABSENT_FROM_EXAMPLE[key])
    assert key in _example_keys(), f"examples/fleet.toml lacks {key}"


def test_the_docs_point_inside_the_repository() -> None:
    for path in (ROOT / "README.md", EXAMPLE, GUIDE):
        text = path.read_text()
        assert "SPEC.md" not in text, path
        assert "shared/" not in text, path
        for linked in re.findall(r"`((?:docs|examples|deploy|e2e|bench|tests)/[\w./-]+)`", text):
            assert (ROOT / linked).exists(), (path.name, linked)
    assert "docs/operator-guide.md" in (ROOT / "README.md").read_text()
    assert "docs/operator-guide.md" in EXAMPLE.read_text()
