"""Cross-field problems are reported in the same pass as field problems (contract 2), and never
one that a key's own problem makes up."""

from __future__ import annotations

import pytest

from narwhal.core.config import ConfigError
from narwhal.core.config_parse import parse_config

ENGINES = (
    '[[engines]]\nid = "p"\nurl = "http://h:1"\nrole = "prefill"\n'
    '[[engines]]\nid = "d"\nurl = "http://h:2"\nrole = "decode"\n'
)


def _problems(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(text.encode(), fmt="toml")
    return info.value.problems


def test_a_field_problem_and_a_cross_field_problem_together() -> None:
    assert _problems(
        'model = "m"\n' + ENGINES + "[serving]\nrequest_timeout_s = 10\nprefill_timeout_s = 20\n"
        "max_inflight = 0\n[engine]\nmax_connections = 0\n"
    ) == [
        "serving.max_inflight: must be an integer >= 1 (got 0)",
        "engine.max_connections: must be an integer >= 1 (got 0)",
        "serving.prefill_timeout_s: must not exceed serving.request_timeout_s (20.0 > 10.0)",
    ]


def test_every_rule_in_one_pass() -> None:
    problems = _problems(
        'model = ""\n'
        '[[engines]]\nid = "a"\nurl = "http://h:1"\nrole = "prefill"\n'
        '[[engines]]\nid = "a"\nurl = "http://h:2"\nrole = "prefill"\n'
        "[serving]\nrequest_timeout_s = 10\nprefill_timeout_s = 20\nhandoff_timeout_s = 11\n"
        "bogus = 1\n[engine]\nfirst_token_timeout_s = 12\n"
        '[recovery]\nrestart_policy = "whole_wave"\n'
    )
    assert [p.split(" (known: ")[0] for p in problems] == [
        "model: must be a non-empty string (got '')",
        "serving.bogus: unknown key in [serving]",
        "serving.prefill_timeout_s: must not exceed serving.request_timeout_s (20.0 > 10.0)",
        "engine.first_token_timeout_s: must not exceed serving.request_timeout_s (12.0 > 10.0)",
        "serving.handoff_timeout_s: must not exceed serving.request_timeout_s (11.0 > 10.0)",
        "engines[1].id: duplicate id 'a' (also engines[0])",
        "engines: no engine can decode (need role 'decode' or 'both')",
        "recovery.restart_policy: 'whole_wave' requires an [engine_contract] section",
    ]


@pytest.mark.parametrize(
    ("head", "tail", "expected"),
    [
        # the deadline itself is invalid: comparing with its default would invent a problem
        (
            "",
            "[serving]\nrequest_timeout_s = -1\nprefill_timeout_s = 700\n",
            ["serving.request_timeout_s: must be a number > 0 (got -1)"],
        ),
        # a section that is not a table: none of its keys is compared
        (
            "serving = 3\n",
            "[engine]\nfirst_token_timeout_s = 700\n",
            ["serving: must be a table/object, got int"],
        ),
        # an [engine_contract] with a problem is still there for whole_wave
        (
            "",
            '[recovery]\nrestart_policy = "whole_wave"\n[engine_contract]\nconnector = "x"\n',
            [
                "engine_contract.engine_version: required key is missing",
                "engine_contract.connector: must be one of 'NixlConnector' (got 'x')",
            ],
        ),
    ],
)
def test_no_problem_is_made_up_by_another(head: str, tail: str, expected: list[str]) -> None:
    assert _problems('model = "m"\n' + head + ENGINES + tail) == expected


def test_an_unknown_key_leaves_the_valid_keys_of_its_section_compared() -> None:
    assert _problems(
        'model = "m"\n' + ENGINES + "[serving]\nrequest_timeout_s = 1000\nbogus = 1\n"
        "[engine]\nfirst_token_timeout_s = 700\ndecode_read_timeout_s = -1\n"
    ) == [
        _problems('model = "m"\n' + ENGINES + "[serving]\nbogus = 1\n")[0],
        "engine.decode_read_timeout_s: must be a number >= 0 (got -1)",
    ]


def test_engines_keep_their_indices_and_roles_are_judged_only_when_all_are_valid() -> None:
    assert _problems(
        'model = "m"\n'
        '[[engines]]\nid = "x"\nurl = "http://h:1"\nrole = "decoder"\n'
        '[[engines]]\nid = "a"\nurl = "http://h:2"\nrole = "prefill"\n'
        '[[engines]]\nid = "a"\nurl = "http://h:3"\nrole = "prefill"\n'
        '[[engines]]\nurl = "http://h:4"\n'
        '[[engines]]\nurl = "http://h:5"\n'
    ) == [
        "engines[0].role: must be one of 'both', 'decode', 'prefill' (got 'decoder')",
        "engines[3].id: required key is missing",
        "engines[4].id: required key is missing",
        "engines[2].id: duplicate id 'a' (also engines[1])",
    ]
