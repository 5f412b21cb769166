"""A leg's faults carry its engine: built with it where the leg's shell knows it, never
changed once raised, and named by id (never by address) to the client."""

from __future__ import annotations

import pytest

from narwhal.core.faults import EngineFaults, EngineUnreachable, Phase, RequestFault


def test_a_fault_raised_inside_a_leg_is_raised_again_as_its_engines() -> None:
    url = "http://10.0.0.5:8000"
    original = EngineUnreachable(f"cannot connect to engine {url}: refused", phase=Phase.DECODE)
    with pytest.raises(RequestFault) as caught, EngineFaults("d0", url):
        raise original
    fault = caught.value
    assert fault is not original
    assert type(fault) is EngineUnreachable
    assert (fault.engine_id, fault.engine_url, fault.status) == ("d0", url, original.status)
    assert fault.client_message() == "cannot connect to engine d0: refused"
    assert original.engine_id is None  # the raised fault is never changed


def test_a_fault_that_names_its_engine_address_keeps_it() -> None:
    mine = EngineUnreachable("boom", phase=Phase.PREFILL, engine_url="http://a:1")
    with pytest.raises(RequestFault) as caught, EngineFaults("p0", "http://b:2"):
        raise mine
    assert (caught.value.engine_id, caught.value.engine_url) == ("p0", "http://a:1")
