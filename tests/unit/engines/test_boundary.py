"""The engine boundary's table, without sockets: every library error it names becomes the
engine fault contract 6 says (status, breaker class, phase, the engine's URL), with the words
a journal line shows; what it does not name passes through unchanged."""

from __future__ import annotations

import socket
import ssl
from collections.abc import Callable

import h11
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from narwhal.core.faults import (
    BreakerClass,
    ConnectTimeout,
    EngineUnreachable,
    Phase,
    StreamBroken,
)
from narwhal.engines.boundary import (
    TABLE,
    BodyTooLarge,
    EngineClosed,
    EngineErrors,
    Rule,
    Step,
)
from narwhal.stream.chunked import ChunkedError

URL = "http://10.0.0.5:8000"

# What a client and the breaker see for each library error, per step, written out from
# contract 6 (not read from the table): (status, breaker class, the fault a journal names)
UNREACHABLE = (502, BreakerClass.UNREACHABLE, EngineUnreachable)
CONNECT_TIMED_OUT = (504, BreakerClass.UNREACHABLE, ConnectTimeout)
BROKEN = (502, BreakerClass.STREAM, StreamBroken)

Build = Callable[[str], BaseException]


def _tls_failure(text: str) -> BaseException:
    broken = trio.BrokenResourceError()
    broken.__cause__ = ssl.SSLError(text)
    return broken


def _os_errors() -> list[Build]:
    return [
        OSError,
        ConnectionRefusedError,
        ConnectionResetError,
        BrokenPipeError,
        TimeoutError,
        socket.gaierror,
        ssl.SSLError,
        lambda text: OSError(104, text),
    ]


# every library error the transport's steps can raise, with what contract 6 makes of it
EXPECTED: dict[Step, list[tuple[Build, tuple[int, BreakerClass, type]]]] = {
    Step.CONNECT: [
        (lambda _: trio.TooSlowError(), CONNECT_TIMED_OUT),
        (_tls_failure, UNREACHABLE),
        *[(build, UNREACHABLE) for build in _os_errors()],
    ],
    Step.EXCHANGE: [
        (h11.RemoteProtocolError, BROKEN),
        (ChunkedError, BROKEN),
        (lambda _: EngineClosed(), BROKEN),
        (lambda _: BodyTooLarge(1024), BROKEN),
        (trio.BrokenResourceError, BROKEN),
        (trio.ClosedResourceError, BROKEN),
        *[(build, BROKEN) for build in _os_errors()],
    ],
}
NOT_MAPPED: list[Build] = [ValueError, KeyError, RuntimeError, h11.LocalProtocolError]

urls = st.sampled_from([URL, "https://vllm-0.internal", "http://[fd00::5]:8000", "http://a:1"])
texts = st.text(max_size=40)


@given(
    step_and_case=st.sampled_from(
        [(step, case) for step, cases in EXPECTED.items() for case in cases]
    ),
    text=texts,
    url=urls,
    phase=st.sampled_from(list(Phase)),
)
def test_every_mapped_error_is_the_fault_spec_6_names(
    step_and_case: tuple[Step, tuple[Build, tuple[int, BreakerClass, type]]],
    text: str,
    url: str,
    phase: Phase,
) -> None:
    step, (build, (status, breaker, fault_class)) = step_and_case
    fault = EngineErrors(step, url, phase).fault(build(text))
    assert type(fault) is fault_class
    assert (fault.status, fault.breaker, fault.transient) == (status, breaker, True)
    assert (fault.phase, fault.engine_url, fault.engine_id) == (phase, url, None)
    assert f"engine {url}" in fault.message


@given(
    step_and_row=st.sampled_from([(step, row) for step, rows in TABLE.items() for row in rows]),
    url=urls,
    phase=st.sampled_from(list(Phase)),
)
def test_every_row_gives_its_fault_with_its_status_and_breaker_class(
    step_and_row: tuple[Step, tuple[type[BaseException], Rule]],
    url: str,
    phase: Phase,
) -> None:
    step, (kind, rule) = step_and_row
    # an error of exactly the row's type: a new row needs its contract 6 line in EXPECTED
    error = next(e for e in (build("x") for build, _ in EXPECTED[step]) if type(e) is kind)
    fault = EngineErrors(step, url, phase).fault(error)
    assert type(fault) is rule.fault
    assert (fault.status, fault.breaker) == (rule.fault.status, rule.fault.breaker)


@pytest.mark.parametrize("step", list(Step))
def test_no_row_is_hidden_behind_an_earlier_one(step: Step) -> None:
    kinds = [kind for kind, _ in TABLE[step]]
    for i, later in enumerate(kinds):
        assert not any(issubclass(later, earlier) for earlier in kinds[:i]), later


@given(
    step=st.sampled_from(list(Step)),
    build=st.sampled_from(NOT_MAPPED),
    text=texts,
)
def test_what_the_table_does_not_name_passes_through_unchanged(
    step: Step, build: Build, text: str
) -> None:
    error = build(text)
    errors = EngineErrors(step, URL, Phase.DECODE)
    assert errors.fault(error) is None
    with pytest.raises(type(error)) as caught, errors:
        raise error
    assert caught.value is error


def test_a_connect_step_does_not_take_a_stream_error_nor_the_reverse() -> None:
    assert EngineErrors(Step.CONNECT, URL, Phase.PREFILL).fault(ChunkedError("x")) is None
    assert EngineErrors(Step.EXCHANGE, URL, Phase.PREFILL).fault(trio.TooSlowError()) is None


@pytest.mark.parametrize(
    ("step", "error", "message"),
    [
        (
            Step.CONNECT,
            OSError("all attempts to connect to 10.0.0.5:8000 failed"),
            f"cannot connect to engine {URL}: all attempts to connect to 10.0.0.5:8000 failed",
        ),
        (
            Step.CONNECT,
            ConnectionRefusedError(),
            f"cannot connect to engine {URL}: ConnectionRefusedError",
        ),
        (Step.CONNECT, trio.TooSlowError(), f"connect to engine {URL} timed out"),
        (
            Step.EXCHANGE,
            ConnectionResetError(104, "Connection reset by peer"),
            f"connection to engine {URL} broke: connection broke: "
            "[Errno 104] Connection reset by peer",
        ),
        (
            Step.EXCHANGE,
            trio.ClosedResourceError(),
            f"connection to engine {URL} broke: connection broke: ClosedResourceError",
        ),
        (
            Step.EXCHANGE,
            h11.RemoteProtocolError("illegal status line"),
            f"connection to engine {URL} broke: engine broke HTTP: illegal status line",
        ),
        (
            Step.EXCHANGE,
            ChunkedError("bad chunk size line b'zz'"),
            f"connection to engine {URL} broke: engine broke HTTP: bad chunk size line b'zz'",
        ),
        (
            Step.EXCHANGE,
            EngineClosed(),
            f"connection to engine {URL} broke: connection closed by engine",
        ),
        (
            Step.EXCHANGE,
            BodyTooLarge(8),
            f"connection to engine {URL} broke: engine response larger than 8 bytes",
        ),
    ],
)
def test_a_fault_keeps_the_libraries_words_and_names_the_engine(
    step: Step, error: BaseException, message: str
) -> None:
    fault = EngineErrors(step, URL, Phase.PREFILL).fault(error)
    assert fault is not None
    assert fault.message == message
    fault.engine_id = "p0"
    assert URL not in fault.client_message()


def test_a_failed_tls_handshake_says_why() -> None:
    refused = ssl.SSLCertVerificationError(1, "certificate verify failed")
    refused.verify_message = "self-signed certificate"
    broken = trio.BrokenResourceError()
    broken.__cause__ = refused
    fault = EngineErrors(Step.CONNECT, URL, Phase.DECODE).fault(broken)
    assert isinstance(fault, EngineUnreachable)
    assert fault.message == (
        f"cannot connect to engine {URL}: TLS handshake failed: "
        "certificate verify failed: self-signed certificate"
    )


def test_a_decode_streams_reads_say_the_stream_ended_first() -> None:
    errors = EngineErrors(Step.EXCHANGE, URL, Phase.DECODE)
    errors.broken = "stream ended before [DONE]: "
    fault = errors.fault(EngineClosed())
    assert fault is not None
    assert fault.message == (
        f"stream ended before [DONE]: connection to engine {URL} broke: connection closed by engine"
    )


def test_the_fault_is_raised_in_the_errors_place_without_its_cause() -> None:
    errors = EngineErrors(Step.EXCHANGE, URL, Phase.DECODE)
    with pytest.raises(StreamBroken) as caught, errors:
        raise BrokenPipeError(32, "Broken pipe")
    assert caught.value.__cause__ is None
    assert caught.value.__suppress_context__


@pytest.mark.parametrize(
    ("error", "gone"),
    [
        (ConnectionResetError(), True),
        (trio.BrokenResourceError(), True),
        (trio.ClosedResourceError(), True),
        (EngineClosed(), True),
        (h11.RemoteProtocolError("bad"), False),
        (ChunkedError("bad"), False),
        (BodyTooLarge(1), False),
    ],
)
def test_only_a_connection_found_gone_is_worth_a_fresh_connection(
    error: BaseException, gone: bool
) -> None:
    errors = EngineErrors(Step.EXCHANGE, URL, Phase.PREFILL)
    errors.gone = not gone  # the last fault's answer, whatever came before
    assert errors.fault(error) is not None
    assert errors.gone is gone
