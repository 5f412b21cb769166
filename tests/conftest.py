"""Fixtures: fake engines and the router on real loopback sockets (real clock, no mocks)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio

from tests.support.fleet import Harness, finish, start_fleet


@pytest.fixture
async def pd(nursery: trio.Nursery) -> AsyncIterator[Harness]:
    """A producer (prefill), a consumer (decode) and the router."""
    harness = await start_fleet(nursery, {"p0": "prefill", "d0": "decode"})
    yield harness
    await finish(harness)
