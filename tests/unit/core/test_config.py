"""The fleet file: defaults, every problem reported with its path (how `serve` refuses a bad
file, as a process, is in tests/process/test_cli_errors.py)."""

from __future__ import annotations

import msgspec
import pytest

from narwhal.core.config import ConfigError
from narwhal.core.config_parse import parse_config

MINIMAL = b"""
model = "m"
[[engines]]
id = "e0"
url = "http://127.0.0.1:9000"
"""


def _problems(text: str, fmt: str = "toml") -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(text.encode(), fmt=fmt)
    return info.value.problems


def test_every_default() -> None:
    fleet = parse_config(MINIMAL, fmt="toml")
    assert fleet.model == "m"
    assert [(e.id, e.url, e.role) for e in fleet.engines] == [
        ("e0", "http://127.0.0.1:9000", "both")
    ]
    assert msgspec.structs.asdict(fleet.serving) == {
        "request_timeout_s": 600.0,
        "prefill_timeout_s": 120.0,
        "handoff_timeout_s": 0.0,
        "max_attempts": 1,
        "retry_budget": 10.0,
        "retry_replenish": 0.1,
        "retry_backoff_s": 0.05,
        "max_inflight": 1024,
        "max_request_bytes": 4194304,
        "api_keys_env": "",
        "admin_keys_env": "",
        "max_fanout": 16,
        "graceful_timeout_s": 30.0,
        "client_idle_timeout_s": 20.0,
        "client_body_timeout_s": 30.0,
    }
    assert msgspec.structs.asdict(fleet.engine) == {
        "first_token_timeout_s": 2.5,
        "decode_read_timeout_s": 10.0,
        "connect_timeout_s": 5.0,
        "health_timeout_s": 5.0,
        "api_key_env": "",
        "max_connections": 512,
        "ca_file": "",
        "health_interval_s": 5.0,
        "kv_lease_s": 30.0,
        "reclaim_orphans": True,
    }
    assert msgspec.structs.asdict(fleet.recovery) == {
        "eject_after": 3,
        "failure_quarantine_s": 0.0,
        "readmit_interval_s": 10.0,
        "restart_policy": "individual",
        "resume_streams": 0,
    }
    assert msgspec.structs.asdict(fleet.placement) == {
        "policy": "least_loaded",
        "metrics_interval_s": 1.0,
        "prefix_affinity": True,
        "affinity_load_factor": 1.25,
        "local_prefill_tokens": 0,
        "local_prefill_when_busy": False,
        "prefix_index_ttl_s": 120.0,
        "adapter_affinity": True,
    }
    assert fleet.engine_contract is None


def test_structs_are_frozen() -> None:
    fleet = parse_config(MINIMAL, fmt="toml")
    with pytest.raises(AttributeError):
        fleet.serving.max_attempts = 3  # type: ignore[misc]


def test_unknown_key_is_named_with_its_section() -> None:
    problems = _problems(MINIMAL.decode() + "[engine]\nfirst_token_timeout = 1.0\n")
    assert len(problems) == 1
    assert problems[0].startswith("engine.first_token_timeout: unknown key in [engine]")


def test_unknown_top_level_key_and_section() -> None:
    problems = _problems('modle = "x"\n' + MINIMAL.decode() + "[servng]\nx = 1\n")
    assert [p.split(":")[0] for p in problems] == ["modle", "servng"]


def test_wrong_type_names_the_path_and_the_rule() -> None:
    problems = _problems(MINIMAL.decode() + '[serving]\nmax_inflight = "lots"\n')
    assert problems == ["serving.max_inflight: must be an integer >= 1 (got 'lots')"]


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        (
            "[engine]\nfirst_token_timeout_s = 0",
            "engine.first_token_timeout_s: must be a number > 0",
        ),
        ("[serving]\nmax_attempts = 9", "serving.max_attempts: must be an integer >= 1 and <= 5"),
        ("[serving]\nmax_attempts = true", "serving.max_attempts: must be an integer"),
        ("[serving]\nretry_budget = -1", "serving.retry_budget: must be a number >= 0"),
        (
            '[recovery]\nrestart_policy = "sometimes"',
            "recovery.restart_policy: must be one of 'individual', 'whole_wave'",
        ),
        (
            '[placement]\npolicy = "random"',
            "placement.policy: must be one of 'least_loaded', 'predicted', 'round_robin'",
        ),
        (
            "[placement]\naffinity_load_factor = 0.5",
            "placement.affinity_load_factor: must be a number >= 1.0",
        ),
        (
            "[engine_contract]\nconnector = 'NixlConnector'",
            "engine_contract.engine_version: required key is missing",
        ),
    ],
)
def test_rule_breaks(section: str, expected: str) -> None:
    problems = _problems(MINIMAL.decode() + section + "\n")
    assert problems[0].startswith(expected), problems


def test_engine_entries_are_checked_one_by_one() -> None:
    problems = _problems(
        'model = "m"\n'
        '[[engines]]\nid = "a"\nurl = "http://h:1"\nrole = "decoder"\n'
        '[[engines]]\nid = "a"\nurl = "ftp://h"\n'
        '[[engines]]\nurl = "http://h:3"\nweight = 2\n'
    )
    assert problems == [
        "engines[0].role: must be one of 'both', 'decode', 'prefill' (got 'decoder')",
        "engines[1].url: must be an http:// or https:// URL, got 'ftp://h'",
        "engines[2].weight: unknown key in [engines[2]] (known: id, kv_events, role, url)",
        "engines[2].id: required key is missing",
        "engines[1].id: duplicate id 'a' (also engines[0])",  # cross-field, same pass
    ]


def test_cross_field_rules() -> None:
    problems = _problems(
        'model = "m"\n'
        '[[engines]]\nid = "a"\nurl = "http://h:1"\nrole = "prefill"\n'
        '[[engines]]\nid = "a"\nurl = "http://h:2"\nrole = "prefill"\n'
        "[serving]\nrequest_timeout_s = 10\nprefill_timeout_s = 20\nhandoff_timeout_s = 11\n"
        "[engine]\nfirst_token_timeout_s = 12\n"
        '[recovery]\nrestart_policy = "whole_wave"\n'
    )
    assert problems == [
        "serving.prefill_timeout_s: must not exceed serving.request_timeout_s (20.0 > 10.0)",
        "engine.first_token_timeout_s: must not exceed serving.request_timeout_s (12.0 > 10.0)",
        "serving.handoff_timeout_s: must not exceed serving.request_timeout_s (11.0 > 10.0)",
        "engines[1].id: duplicate id 'a' (also engines[0])",
        "engines: no engine can decode (need role 'decode' or 'both')",
        "recovery.restart_policy: 'whole_wave' requires an [engine_contract] section",
    ]


def test_several_problems_are_reported_together() -> None:
    problems = _problems(
        "[serving]\nmax_inflight = 0\nbogus = 1\n[engine]\nconnect_timeout_s = 'x'\n"
    )
    assert problems == [
        "model: required key is missing",
        "engines: required, at least one [[engines]] entry",
        "serving.bogus: unknown key in [serving] (known: admin_keys_env, api_keys_env, "
        "client_body_timeout_s, "
        "client_idle_timeout_s, graceful_timeout_s, handoff_timeout_s, max_attempts, "
        "max_fanout, max_inflight, max_request_bytes, prefill_timeout_s, request_timeout_s, "
        "retry_backoff_s, retry_budget, retry_replenish)",
        "serving.max_inflight: must be an integer >= 1 (got 0)",
        "engine.connect_timeout_s: must be a number > 0 (got 'x')",
    ]


def test_syntax_errors_and_bad_extensions() -> None:
    assert _problems("model = ")[0].startswith("syntax:")
    assert _problems("{}", fmt="yaml") == ["file extension: must be .toml or .json, got 'yaml'"]


def test_kv_events_keys_are_checked() -> None:
    bad = (
        b'model = "m"\n[[engines]]\nid = "e"\nurl = "http://h:1"\nkv_events = "udp://h:1"\n'
        b'[kv_events]\nmode = "listen"\nlisten = "tcp://nohost"\ntokenizer = "vocab.txt"\n'
    )
    with pytest.raises(ConfigError) as caught:
        parse_config(bad, fmt="toml")
    assert caught.value.problems == [
        "kv_events.listen: must be a tcp://host:port endpoint, got 'tcp://nohost'",
        "kv_events.tokenizer: must be 'engine' (the engine's own /tokenize) or the path of a "
        "tokenizer.json, got 'vocab.txt'",
        "engines[0].kv_events: must be a tcp://host:port endpoint, got 'udp://h:1'",
    ]
    good = bad.replace(b"udp://h:1", b"tcp://h:5557").replace(b"tcp://nohost", b"tcp://*:5557")
    fleet = parse_config(good.replace(b"vocab.txt", b"/m/tokenizer.json"), fmt="toml")
    assert fleet.kv_events.tokenizer == "/m/tokenizer.json"
