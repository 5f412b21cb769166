"""A leg's faults carry its engine: built with it where the leg's shell knows it, never
changed once raised, and named by id (never by address) to the client. Every answer the
router gives itself is a fault that renders its own bytes; a clock that ran out is its
fault."""

from __future__ import annotations

import pytest

from narwhal.core.clocks import Clock, ran_out
from narwhal.core.config import ConfigError
from narwhal.core.faults import (
    AtEngine,
    BadRequest,
    DeadlineExpired,
    EngineUnreachable,
    FirstTokenTimeout,
    Forbidden,
    FramingError,
    InvalidFleetFile,
    MethodNotAllowed,
    NoSuchEndpoint,
    Phase,
    PrefillTimeout,
    ReloadNotApplied,
    ReloadUnanswered,
    RequestFault,
    ShuttingDown,
    SilenceTimeout,
    Unauthorized,
)


def test_a_fault_raised_inside_a_leg_is_raised_again_as_its_engines() -> None:
    url = "http://10.0.0.5:8000"
    original = EngineUnreachable(f"cannot connect to engine {url}: refused", phase=Phase.DECODE)
    with pytest.raises(RequestFault) as caught, AtEngine("d0", url):
        raise original
    fault = caught.value
    assert fault is not original
    assert type(fault) is EngineUnreachable
    assert (fault.engine_id, fault.engine_url, fault.status) == ("d0", url, original.status)
    assert fault.client_message() == "cannot connect to engine d0: refused"
    assert original.engine_id is None  # the raised fault is never changed


def test_a_fault_that_names_its_engine_address_keeps_it() -> None:
    mine = EngineUnreachable("boom", phase=Phase.PREFILL, engine_url="http://a:1")
    with pytest.raises(RequestFault) as caught, AtEngine("p0", "http://b:2"):
        raise mine
    assert (caught.value.engine_id, caught.value.engine_url) == ("p0", "http://a:1")


# ---- every answer the router gives itself renders its own JSON --------------------------


@pytest.mark.parametrize(
    ("fault", "status", "body"),
    [
        (
            Unauthorized(),
            401,
            b'{"error":{"message":"missing or invalid API key",'
            b'"type":"authentication_error","param":null,"code":401}}',
        ),
        (
            Forbidden("admin endpoint: loopback only"),
            403,
            b'{"error":{"message":"admin endpoint: loopback only",'
            b'"type":"permission_error","param":null,"code":403}}',
        ),
        (
            NoSuchEndpoint("GET", "/nope"),
            404,
            b'{"error":{"message":"no such endpoint: GET /nope",'
            b'"type":"not_found_error","param":null,"code":404}}',
        ),
        (
            MethodNotAllowed("/v1/completions"),
            405,
            b'{"error":{"message":"/v1/completions takes POST",'
            b'"type":"method_not_allowed","param":null,"code":405}}',
        ),
        (
            InvalidFleetFile(ConfigError("fleet.toml", ["engines[0].url: not a URL"])),
            400,
            b'{"error":{"message":"invalid fleet file fleet.toml: 1 problem(s)\\n'
            b'  engines[0].url: not a URL","type":"invalid_fleet_file","param":null,'
            b'"code":400,"problems":["engines[0].url: not a URL"]}}',
        ),
        (
            ReloadUnanswered(),
            504,
            b'{"error":{"message":"reload: the parent process did not answer; the workers '
            b'may differ","type":"reload_incomplete","param":null,"code":504}}',
        ),
        (
            ReloadNotApplied([1], [{"worker": 0, "pid": 7}, {"worker": 1, "error": "no"}]),
            409,
            b'{"error":{"message":"reload did not apply on worker(s) [1]; the workers may '
            b'differ","type":"reload_incomplete","param":null,"code":409,'
            b'"workers":[{"worker":0,"pid":7},{"worker":1,"error":"no"}]}}',
        ),
        (
            FramingError(400, "request framing: malformed HTTP/1.1 (400)"),
            400,
            b'{"error":{"message":"request framing: malformed HTTP/1.1 (400)",'
            b'"type":"invalid_request_error","param":null,"code":400}}',
        ),
        (
            FramingError(413, "chunk past max_request_bytes"),
            413,
            b'{"error":{"message":"chunk past max_request_bytes",'
            b'"type":"request_too_large","param":null,"code":413}}',
        ),
        (
            BadRequest("websocket: not served here; the API is plain HTTP"),
            400,
            b'{"error":{"message":"websocket: not served here; the API is plain HTTP",'
            b'"type":"invalid_request_error","param":null,"code":400}}',
        ),
    ],
)
def test_an_answer_the_router_gives_itself_is_its_fault_rendered(
    fault: RequestFault, status: int, body: bytes
) -> None:
    assert fault.answer() == (status, body)


# ---- a clock that ran out is its fault ----------------------------------------------------


class _Scope:
    def __init__(self, cancelled_caught: bool) -> None:
        self.cancelled_caught = cancelled_caught


@pytest.mark.parametrize(
    ("clock", "phase", "fault_class", "status", "message"),
    [
        (Clock.DEADLINE, Phase.DECODE, DeadlineExpired, 504, "request deadline expired after 30s"),
        (
            Clock.DRAIN,
            Phase.STREAM,
            ShuttingDown,
            503,
            "router shutting down: the request outlived the graceful timeout (30s)",
        ),
        (
            Clock.PREFILL,
            Phase.PREFILL,
            PrefillTimeout,
            504,
            "prefill on engine p0 took longer than 30s",
        ),
        (
            Clock.FIRST_TOKEN,
            Phase.DECODE,
            FirstTokenTimeout,
            504,
            "no first token within 30s from engine p0",
        ),
        (
            Clock.SILENCE,
            Phase.STREAM,
            SilenceTimeout,
            504,
            "engine went silent between tokens: nothing from engine p0 for 30s",
        ),
    ],
)
def test_a_clock_that_ran_out_is_its_fault(
    clock: Clock, phase: Phase, fault_class: type[RequestFault], status: int, message: str
) -> None:
    fault = ran_out(clock, 30.0, phase=phase, engine_id="p0", scope=_Scope(True))
    assert type(fault) is fault_class
    assert (fault.status, fault.message, fault.phase) == (status, message, phase)


def test_a_pass_through_leg_is_named_by_its_path() -> None:
    fault = ran_out(Clock.PREFILL, 2.5, phase=Phase.PREFILL, engine_id="p1", leg="/tokenize")
    assert fault.message == "/tokenize on engine p1 took longer than 2.5s"
    assert fault.engine_id == "p1"


def test_a_scope_that_did_not_run_out_is_no_timeout() -> None:
    with pytest.raises(ValueError, match="did not run out"):
        ran_out(Clock.SILENCE, 1.0, phase=Phase.STREAM, engine_id="d0", scope=_Scope(False))
