"""What keeps `narwhal` from starting is one line on stderr and an exit status of its own,
never a traceback (contract 3): each case run from outside, as `python -m narwhal ...`."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme
from cryptography.hazmat.primitives import serialization

from narwhal.frontdoor.internals_check import InternalsMismatch
from narwhal.process import build, cli, startup
from tests.support.processes import run_narwhal

FLEET = 'model = "m"\n[[engines]]\nid = "e0"\nurl = "http://127.0.0.1:9"\n'


def _said(done: subprocess.CompletedProcess[str]) -> tuple[int, str]:
    """The process's exit status and what it said: its one line on stderr, or everything it
    wrote when that was anything else (more lines, none, a traceback)."""
    output = done.stdout + done.stderr
    lines = done.stderr.splitlines()
    one_line = len(lines) == 1 and "Traceback" not in output
    return done.returncode, lines[0] if one_line else output


@pytest.fixture
def fleet(tmp_path: Path) -> Path:
    path = tmp_path / "fleet.toml"
    path.write_text(FLEET)
    return path


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another socket listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_the_exit_statuses_are_distinct() -> None:
    codes = [
        getattr(startup, name)
        for name in dir(startup)
        if name.startswith("EXIT_") and "HELP" not in name
    ]
    assert sorted(codes) == list(range(1, 9))
    for code in codes:
        assert f"\n  {code}  " in startup.EXIT_STATUS_HELP


def test_a_missing_fleet_file(tmp_path: Path) -> None:
    absent = tmp_path / "absent.toml"
    for command in ("serve", "check"):
        assert _said(run_narwhal(command, "--config", str(absent))) == (
            startup.EXIT_NO_FLEET_FILE,
            f"narwhal: cannot read the fleet file {absent}: No such file or directory",
        )
    assert _said(run_narwhal("serve", "--config", str(tmp_path))) == (
        startup.EXIT_NO_FLEET_FILE,
        f"narwhal: cannot read the fleet file {tmp_path}: Is a directory",
    )


def test_an_invalid_fleet_file_lists_its_problems_not_a_traceback(tmp_path: Path) -> None:
    files = {  # a file with no engines, and one whose every section has a problem
        'model = "m"\n[serving]\nmax_inflight = 0\n': [
            "engines: required, at least one [[engines]] entry",
            "serving.max_inflight: must be an integer >= 1 (got 0)",
        ],
        'model = ""\n[[engines]]\nid = "e"\nurl = "nope"\n[engine]\nmax_connections = 0\n': [
            "model: must be a non-empty string (got '')",
            "engines[0].url: must be an http:// or https:// URL, got 'nope'",
            "engine.max_connections: must be an integer >= 1 (got 0)",
        ],
    }
    for n, (text, problems) in enumerate(files.items()):
        bad = tmp_path / f"bad{n}.toml"
        bad.write_text(text)
        done = run_narwhal("serve", "--config", str(bad))
        assert done.returncode == startup.EXIT_INVALID_FLEET == 2
        assert "Traceback" not in done.stderr
        assert done.stderr.splitlines() == [
            f"invalid fleet file {bad}: {len(problems)} problem(s)",
            *(f"  {problem}" for problem in problems),
        ]


def test_a_journal_that_cannot_be_opened(tmp_path: Path, fleet: Path) -> None:
    missing = tmp_path / "no-such-dir" / "journal.jsonl"
    serve = ("serve", "--config", str(fleet), "--port", "0", "--journal")
    assert _said(run_narwhal(*serve, str(missing))) == (
        startup.EXIT_JOURNAL,
        f"narwhal: cannot open the journal {missing}: "
        f"its directory {missing.parent} does not exist",
    )
    # a directory stands in for an unwritable path (the tests may run as root)
    assert _said(run_narwhal(*serve, str(tmp_path))) == (
        startup.EXIT_JOURNAL,
        f"narwhal: cannot open the journal {tmp_path}: Is a directory",
    )


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_taken_port(fleet: Path, taken_port: int, workers: str) -> None:
    args = ("--config", str(fleet), "--port", str(taken_port), "--workers", workers)
    assert _said(run_narwhal("serve", *args)) == (
        startup.EXIT_PORT,
        f"narwhal: cannot listen on 127.0.0.1:{taken_port}: "
        f"port {taken_port} is taken by another process",
    )


def test_the_demo_on_a_taken_port(taken_port: int) -> None:
    status, said = _said(run_narwhal("demo", "--port", str(taken_port)))
    assert status == startup.EXIT_PORT, said
    pattern = re.escape(f"narwhal: cannot listen on 127.0.0.1:{taken_port}: ") + ".*taken.*"
    assert re.fullmatch(pattern, said), said


def test_a_bad_host(fleet: Path) -> None:
    serve = ("serve", "--config", str(fleet), "--port", "0", "--host")
    status, said = _said(run_narwhal(*serve, "no-such-host.invalid"))
    assert status == startup.EXIT_HOST, said
    unresolved = re.escape(
        "narwhal: cannot listen on no-such-host.invalid:0: "
        "the host 'no-such-host.invalid' does not resolve ("
    )
    assert re.fullmatch(unresolved + ".+\\)", said), said
    # TEST-NET-1 (RFC 5737): an address, but never one of this machine's
    assert _said(run_narwhal(*serve, "192.0.2.1")) == (
        startup.EXIT_HOST,
        "narwhal: cannot listen on 192.0.2.1:0: 192.0.2.1 is not an address of this machine",
    )


@pytest.fixture(scope="module")
def pems(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A certificate and its key, another key, an encrypted key, a file that is no PEM."""
    ca = trustme.CA()
    where = tmp_path_factory.mktemp("pems")
    issued = ca.issue_cert("127.0.0.1")
    files = {
        "cert": issued.cert_chain_pems[0],
        "key": issued.private_key_pem,
        "other_key": ca.issue_cert("127.0.0.1").private_key_pem,
    }
    paths = {}
    for name, blob in files.items():
        paths[name] = where / f"{name}.pem"
        blob.write_to_path(str(paths[name]))
    key = serialization.load_pem_private_key(issued.private_key_pem.bytes(), password=None)
    paths["encrypted_key"] = where / "encrypted.pem"
    paths["encrypted_key"].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    paths["garbage"] = where / "garbage.pem"
    paths["garbage"].write_text("not a certificate\n")
    paths["absent"] = where / "absent.pem"
    return paths


@pytest.mark.parametrize(
    ("cert", "key", "pattern"),
    [
        ("cert", None, "narwhal: --ssl-certfile needs --ssl-keyfile too .*"),
        (None, "key", "narwhal: --ssl-keyfile needs --ssl-certfile too .*"),
        ("absent", "key", "narwhal: cannot read --ssl-certfile .*absent.pem: No such file.*"),
        ("cert", "absent", "narwhal: cannot read --ssl-keyfile .*absent.pem: No such file.*"),
        ("garbage", "key", "narwhal: --ssl-certfile .*garbage.pem holds no PEM certificate"),
        ("key", "key", "narwhal: --ssl-certfile .*key.pem holds no PEM certificate"),
        ("cert", "garbage", "narwhal: --ssl-keyfile .*: not an unencrypted PEM private key"),
        ("cert", "encrypted_key", "narwhal: --ssl-keyfile .*: not an unencrypted PEM private key"),
        (
            "cert",
            "other_key",
            "narwhal: --ssl-keyfile .*other_key.pem: the key does not match the certificate in "
            ".*cert.pem",
        ),
    ],
)
def test_tls_files_that_cannot_be_used(
    fleet: Path, pems: dict[str, Path], cert: str | None, key: str | None, pattern: str
) -> None:
    args = ["serve", "--config", str(fleet), "--port", "0"]
    if cert:
        args += ["--ssl-certfile", str(pems[cert])]
    if key:
        args += ["--ssl-keyfile", str(pems[key])]
    status, said = _said(run_narwhal(*args))
    assert status == startup.EXIT_TLS, said
    assert re.fullmatch(pattern, said), said


def test_other_versions_of_the_subclassed_internals(monkeypatch: pytest.MonkeyPatch) -> None:
    def mismatch() -> None:
        raise InternalsMismatch("hypercorn.trio.tcp_server:TCPServer.run changed")

    monkeypatch.setattr("narwhal.frontdoor.server.verify_internals", mismatch)
    with pytest.raises(startup.StartupError) as info:
        startup._verify_internals()
    assert info.value.status == startup.EXIT_VERSIONS
    assert info.value.message == (
        "narwhal: cannot start: hypercorn.trio.tcp_server:TCPServer.run changed"
    )


def test_version() -> None:
    done = run_narwhal("--version")
    assert done.returncode == 0, done.stderr
    # the version, and the build that runs (docs/build.md)
    assert done.stdout == (f"narwhal {importlib.metadata.version('narwhal')}, {build.describe()}\n")


def test_every_help_shows_the_defaults() -> None:
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(subparsers.choices) == {"serve", "check", "fake-engine", "demo"}
    for name, sub in subparsers.choices.items():
        text = " ".join(sub.format_help().split())
        for action in sub._actions:
            default = action.default
            if not action.option_strings or action.required or default == argparse.SUPPRESS:
                continue
            if default is None or default is False or "(default" in (action.help or ""):
                continue  # nothing to show, or the help says it in words
            assert f"(default: {default})" in text, (name, action.dest)
        if name in ("serve", "check"):
            assert "exit status: 0" in text


def test_absurd_worker_counts_are_a_command_line_error(fleet: Path) -> None:
    done = run_narwhal("serve", "--config", str(fleet), "--port", "0", "--workers", "100000")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "--workers: at most 256" in done.stderr


def test_the_fake_engine_on_a_taken_port(taken_port: int) -> None:
    status, said = _said(run_narwhal("fake-engine", "--port", str(taken_port)))
    assert status == startup.EXIT_PORT, said
    taken = f"narwhal: cannot listen on 127.0.0.1:{taken_port}: port {taken_port} is taken"
    assert re.fullmatch(re.escape(taken) + ".*", said), said


def test_with_json_logs_what_keeps_serve_from_starting_is_one_json_object(
    tmp_path: Path,
) -> None:
    """``--log-format json``: every line ``serve`` writes to stderr is one JSON object
    (operator guide), its start-up errors too."""
    bad = tmp_path / "bad.toml"
    bad.write_text('model = "m"\n[serving]\nmax_inflight = 0\n')
    for config, status, start in (
        (tmp_path / "absent.toml", startup.EXIT_NO_FLEET_FILE, "narwhal: cannot read the fleet"),
        (bad, startup.EXIT_INVALID_FLEET, f"invalid fleet file {bad}: 2 problem(s)\n  engines:"),
    ):
        done = run_narwhal("serve", "--config", str(config), "--log-format", "json")
        assert done.returncode == status, done.stderr
        (line,) = done.stderr.splitlines()
        record = json.loads(line)
        assert (record["level"], record["exit_status"]) == ("error", status)
        assert record["msg"].startswith(start)
