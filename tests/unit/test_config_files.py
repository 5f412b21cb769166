"""The fleet file on disk (``narwhal.process.config_files``): read by its extension, a file that
cannot be read or a CA bundle that does not load named like any other problem."""

from __future__ import annotations

from pathlib import Path

import pytest

from narwhal.core.config import ConfigError, FleetConfig
from narwhal.core.config_parse import parse_config
from narwhal.process.config_files import FleetFileUnreadable, load_config, load_config_bytes
from tests.support.paths import ROOT

MINIMAL = b"""
model = "m"
[[engines]]
id = "e0"
url = "http://127.0.0.1:9000"
"""


def test_the_example_fleet_file_sets_every_key_to_its_default() -> None:
    example = load_config(ROOT / "examples" / "fleet.toml")
    defaults = parse_config(MINIMAL, fmt="toml")
    assert example.serving == defaults.serving
    assert example.engine == defaults.engine
    assert example.recovery == defaults.recovery
    assert [e.role for e in example.engines] == ["prefill", "decode"]


def test_json_is_accepted_by_extension(tmp_path: Path) -> None:
    path = tmp_path / "fleet.json"
    path.write_text(
        '{"model": "m", "engines": [{"id": "a", "url": "http://h:1", "role": "prefill"},'
        ' {"id": "b", "url": "http://h:2", "role": "decode"}], "serving": {"max_attempts": 2}}'
    )
    fleet = load_config(path)
    assert isinstance(fleet, FleetConfig)
    assert fleet.serving.max_attempts == 2


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read file"):
        load_config(tmp_path / "absent.toml")


def test_a_directory_is_a_file_that_cannot_be_read(tmp_path: Path) -> None:
    with pytest.raises(FleetFileUnreadable) as caught:
        load_config(tmp_path)
    assert caught.value.problems == ["cannot read file: Is a directory"]
    assert caught.value.render().startswith(f"invalid fleet file {tmp_path}: 1 problem(s)")


def test_a_ca_bundle_that_does_not_load_is_listed_after_the_cross_field_problems(
    tmp_path: Path,
) -> None:
    missing = str(tmp_path / "nope.pem")
    text = (
        MINIMAL
        + f'[serving]\nrequest_timeout_s = 100.0\n[engine]\nca_file = "{missing}"\n'.encode()
    )
    with pytest.raises(ConfigError) as caught:
        load_config_bytes(text, fmt="toml", source="fleet.toml")
    assert caught.value.problems == [
        "serving.prefill_timeout_s: must not exceed serving.request_timeout_s (120.0 > 100.0)",
        f"engine.ca_file: cannot load CA bundle {missing!r}: No such file or directory",
    ]
    with pytest.raises(ConfigError) as pure:  # the core checks the keys, not the disk
        parse_config(text, fmt="toml")
    assert pure.value.problems == caught.value.problems[:1]
