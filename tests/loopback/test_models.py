"""Models and LoRA adapters behind one router, over loopback (contract 4.7): fake engines that
serve a base model and adapters (``--models``), the router learning what each serves from
its ``GET /v1/models``, routing by ``model``, aliases, adapter affinity, and room per model."""

from __future__ import annotations

from collections import Counter
from typing import Any

import msgspec
import trio

from narwhal.core.config import (
    AdmissionConfig,
    EngineSpec,
    FleetConfig,
    PlacementConfig,
    ServingConfig,
)
from narwhal.fake_engine.config import FakeEngineConfig
from narwhal.fake_engine.engine import FakeEngine
from narwhal.fake_engine.faults import Fault
from narwhal.router.journal import Journal
from narwhal.router.service import Router
from tests.support.fleet import MODEL, Harness, RawReply, finish, post_raw, serve_router

BASE_AND_A = (MODEL, f"a:{MODEL}")
ALIASES = {"alias-a": "a"}


async def _fleet(
    nursery: trio.Nursery,
    engines: dict[str, tuple[str, tuple[str, ...]]],
    *,
    engine: dict[str, Any] | None = None,
    **sections: Any,
) -> Harness:
    """Fake engines ({id: (role, served names)}) and a router over them, with ALIASES."""
    fakes: dict[str, FakeEngine] = {}
    specs = []
    for eid, (role, models) in engines.items():
        config = FakeEngineConfig(model=MODEL, models=models, role=role, **(engine or {}))  # type: ignore[arg-type]
        fake = FakeEngine(config)
        specs.append(EngineSpec(eid, await nursery.start(fake.serve), role))  # type: ignore[arg-type]
        fakes[eid] = fake
    serving = sections.pop("serving", ServingConfig(graceful_timeout_s=0.5))
    fleet = FleetConfig(
        model=MODEL, engines=tuple(specs), serving=serving, aliases=ALIASES, **sections
    )
    return await serve_router(nursery, Router(fleet, journal=Journal(keep=10_000)), fakes)


def _mixed() -> dict[str, tuple[str, tuple[str, ...]]]:
    """p0 and d0 serve the adapter ``a`` beside the base model; p1 and d1 the base only."""
    return {
        "p0": ("prefill", BASE_AND_A),
        "p1": ("prefill", (MODEL,)),
        "d0": ("decode", BASE_AND_A),
        "d1": ("decode", (MODEL,)),
    }


def _text(reply: Any) -> str:
    return str(reply.json()["choices"][0]["text"])


async def _complete(h: Harness, model: str, prompt: str = "hello there") -> Any:
    return await h.post("/v1/completions", _body(model, prompt))


async def test_an_adapter_is_served_only_by_engines_that_have_it_with_the_handoff_made() -> None:
    async with trio.open_nursery() as nursery:
        h = await _fleet(nursery, _mixed())
        d0 = h.router.fleet.by_id["d0"].url
        alone = await h.http.request(
            "POST", d0 + "/v1/completions", content=msgspec.json.encode(_body("a", "hello there"))
        )
        direct = msgspec.json.decode(alone.content)["choices"][0]["text"]
        base = await _complete(h, MODEL)
        for _ in range(6):
            reply = await _complete(h, "a")
            assert reply.status == 200, reply.body
            assert _text(reply) == direct
            assert reply.json()["model"] == "a"
            attempt = h.router.journal.lines[-1].attempts[0]
            assert (attempt.producer, attempt.consumer, attempt.handoff_fate) == (
                "p0",
                "d0",
                "decoded",
            )
            assert h.router.journal.lines[-1].model == "a"
        assert _text(base) != direct  # the adapter says something else

        # the engines saw the adapter's name on both legs
        def legs(eid: str) -> int:
            return sum(1 for r in h.engines[eid].log if (r.get("body") or {}).get("model") == "a")

        assert (legs("p0"), legs("d0")) == (6, 6 + 1)  # and the one asked of it directly
        assert (legs("p1"), legs("d1")) == (0, 0)
        await finish(h)
        nursery.cancel_scope.cancel()


async def test_the_base_model_goes_anywhere_and_an_alias_is_its_target() -> None:
    async with trio.open_nursery() as nursery:
        h = await _fleet(nursery, _mixed())
        consumers = Counter()
        for i in range(12):
            reply = await _complete(h, MODEL, f"prompt number {i}")
            assert reply.status == 200
            consumers[h.router.journal.lines[-1].attempts[0].consumer] += 1
        assert set(consumers) == {"d0", "d1"}
        aliased, named = await _complete(h, "alias-a"), await _complete(h, "a")
        assert aliased.status == 200
        assert _text(aliased) == _text(named)
        assert h.router.journal.lines[-2].model == "a"
        assert h.router.journal.lines[-2].attempts[0].consumer == "d0"
        await finish(h)
        nursery.cancel_scope.cancel()


async def test_a_name_nobody_serves_is_a_404_and_models_lists_every_name() -> None:
    async with trio.open_nursery() as nursery:
        h = await _fleet(nursery, _mixed())
        reply = await _complete(h, "b")
        assert reply.status == 404
        assert reply.json()["error"]["message"] == "model 'b' is not served here"
        listed = {m["id"]: m for m in (await h.get("/v1/models")).json()["data"]}
        assert set(listed) == {MODEL, "a", "alias-a"}
        assert listed["a"]["parent"] == MODEL
        assert listed[MODEL]["parent"] is None
        assert listed["alias-a"]["root"] == "a"
        view = {e["id"]: e for e in (await h.get("/narwhal/engines")).json()["engines"]}
        assert view["d0"]["models"] == [
            {"id": MODEL, "parent": None},
            {"id": "a", "parent": MODEL},
        ]
        assert view["d1"]["models"] == [{"id": MODEL, "parent": None}]
        # the tokenizer endpoints go to an engine that serves the name too
        for _ in range(4):
            tokenized = await h.post("/tokenize", {"model": "alias-a", "prompt": "two words"})
            assert tokenized.status == 200, tokenized.body
            attempt = h.router.journal.lines[-1].attempts[0]
            assert (attempt.producer or attempt.consumer) in {"p0", "d0"}
        unknown = await h.post("/tokenize", {"model": "b", "prompt": "x"})
        assert unknown.status == 404
        await finish(h)
        nursery.cancel_scope.cancel()


async def test_the_adapters_engines_all_down_is_a_503_not_a_404() -> None:
    async with trio.open_nursery() as nursery:
        h = await _fleet(nursery, _mixed())
        h.engines["d0"].stop()
        for _ in range(2):  # two checks in a row: it left
            await h.router.health.check_all()
        reply = await _complete(h, "a")
        assert reply.status == 503, reply.body
        assert "no placeable consumer" in reply.json()["error"]["message"]
        assert (await _complete(h, MODEL)).status == 200
        await finish(h)
        nursery.cancel_scope.cancel()


async def test_a_malformed_model_list_is_counted_and_the_last_good_one_kept() -> None:
    async with trio.open_nursery() as nursery:
        h = await _fleet(nursery, _mixed())
        d0 = h.engines["d0"]
        for garbage in (b"not json", b'{"data": [{"id": 7}]}', b'{"data": "x"}' + b" " * 2**21):
            d0._models = lambda garbage=garbage: garbage  # type: ignore[method-assign]
            await h.router.health.check_all()
        view = {e["id"]: e for e in (await h.get("/narwhal/engines")).json()["engines"]}
        assert view["d0"]["models_refused"] == 3
        assert {m["id"] for m in view["d0"]["models"]} == {MODEL, "a"}
        metrics = (await h.get("/metrics")).body.decode()
        assert 'narwhal_engine_model_lists_refused_total{engine="d0"} 3.0' in metrics
        assert (await _complete(h, "a")).status == 200
        await finish(h)
        nursery.cancel_scope.cancel()


async def _held_stream(
    h: Harness, nursery: trio.Nursery, body: dict[str, Any]
) -> tuple[str, trio.CancelScope]:
    """A streamed request that stays running on its consumer (two tokens, then silence),
    started here: the consumer it runs on, and the scope that ends it."""
    for eid in ("d0", "d1"):
        h.engines[eid].faults.push(Fault(kind="tokens_then_silence", leg="decode", tokens=2))
    held = trio.CancelScope()

    async def hold() -> None:
        with held:
            await post_raw(h, "/v1/completions", {**body, "stream": True})

    nursery.start_soon(hold)
    found: list[str] = []
    with trio.fail_after(10):
        async with trio.open_nursery() as watching:
            for eid in ("d0", "d1"):

                async def running(eid: str = eid) -> None:
                    await h.engines[eid].wait_running()
                    found.append(eid)
                    watching.cancel_scope.cancel()

                watching.start_soon(running)
    for eid in ("d0", "d1"):
        h.engines[eid].faults.clear()
    for engine in h.router.fleet.engines:  # their reports as of now: the adapter runs
        assert await h.router.scraper.scrape(engine)
    return found[0], held


async def test_adapter_affinity_sends_an_adapter_where_it_runs_and_another_to_a_free_slot() -> None:
    """Consumers with one adapter slot each; ``a`` runs on one of them (its
    vllm:lora_requests_info says so). A request for ``a`` goes there, though that engine
    is the busier; one for ``b`` goes to the other, which has a free slot. With affinity
    off, the lighter engine takes ``a`` and pays a swap later."""
    names = (MODEL, f"a:{MODEL}", f"b:{MODEL}")
    engines = {"p0": ("prefill", names), "d0": ("decode", names), "d1": ("decode", names)}
    for affinity in (True, False):
        async with trio.open_nursery() as nursery:
            h = await _fleet(
                nursery,
                engines,
                engine={"max_loras": 1},
                placement=PlacementConfig(metrics_interval_s=60.0, adapter_affinity=affinity),
            )
            busy, held = await _held_stream(h, nursery, _body("a", "held"))
            other = ({"d0", "d1"} - {busy}).pop()
            assert (await _complete(h, "a")).status == 200
            took_a = h.router.journal.lines[-1].attempts[0].consumer
            assert (await _complete(h, "b")).status == 200
            took_b = h.router.journal.lines[-1].attempts[0].consumer
            if affinity:
                assert (took_a, took_b) == (busy, other)
                # the consumers swapped nothing (the one producer's one slot did, for b)
                assert [h.engines[e].stats()["lora_swaps"] for e in ("d0", "d1")] == [0, 0]
            else:
                assert took_a == other  # the lighter one, as for any model
            held.cancel()
            await finish(h, disconnects=1)
            nursery.cancel_scope.cancel()


async def test_a_saturated_adapter_does_not_hold_back_another_models_requests() -> None:
    """The adapter's one producer is saturated (a prefill of its own hangs there, and one
    leg not started is the limit): a second request for the adapter waits in the admission
    queue, and a request for the base model, whose other producer has room, passes it by.
    Once the hanging prefill ends, the adapter's request goes."""
    engines = {
        "p0": ("prefill", BASE_AND_A),
        "p1": ("prefill", (MODEL,)),
        "d0": ("decode", BASE_AND_A),
        "d1": ("decode", (MODEL,)),
    }
    async with trio.open_nursery() as nursery:
        h = await _fleet(
            nursery,
            engines,
            admission=AdmissionConfig(engine_waiting_limit=1, max_queue_wait_s=20.0),
            placement=PlacementConfig(metrics_interval_s=0.0),
        )
        h.engines["p0"].faults.push(Fault(kind="hang", leg="prefill"))
        held = trio.CancelScope()

        async def hold() -> None:
            with held:
                await post_raw(h, "/v1/completions", _body("a", "held"))

        nursery.start_soon(hold)
        with trio.fail_after(10):
            await h.engines["p0"].wait_running()
        waited: list[RawReply] = []
        answered = trio.Event()

        async def queued() -> None:
            waited.append(await post_raw(h, "/v1/completions", _body("a", "queued")))
            answered.set()

        nursery.start_soon(queued)
        await _queued(h, 1)
        base = await _complete(h, MODEL)
        assert base.status == 200
        assert h.router.journal.lines[-1].attempts[0].producer == "p1"
        assert h.router.admission.queued() == 1  # the adapter's request still waits
        held.cancel()
        with trio.fail_after(10):
            await answered.wait()
        assert waited[0].status == 200
        await finish(h, disconnects=1)
        nursery.cancel_scope.cancel()


def _body(model: str, prompt: str) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": 6}


async def _queued(h: Harness, n: int) -> None:
    """Return once ``n`` requests wait in the admission queue, as an operator sees it."""
    for _ in range(500):
        if sum((await h.get("/narwhal/engines")).json()["queued"].values()) == n:
            return
    raise AssertionError(f"the queue never held {n}")


async def test_the_tokenizer_endpoints_keep_the_body_and_name_the_field() -> None:
    async with trio.open_nursery() as nursery:
        h = await _fleet(nursery, _mixed())
        # an alias is rewritten and the rest of the body kept as it came (a number no
        # float holds included: the engine judges it, never a 500 from the router)
        huge = b'{"model":"alias-a","prompt":"hi","x":1e400}'
        reply = await h.post("/tokenize", huge)
        assert reply.status in (200, 400), reply.body
        assert reply.headers["content-type"].startswith("application/json")
        sent = [e for eid in ("p0", "d0") for e in h.engines[eid].log if e["path"] == "/tokenize"]
        assert len(sent) == 1
        wrong = await h.post("/tokenize", {"model": ["a"], "prompt": "hi"})
        assert wrong.status == 400
        assert wrong.json()["error"]["param"] == "model"
        for _ in range(4):  # no model: the fleet's model's engines
            assert (await h.post("/tokenize", {"prompt": "hi"})).status == 200
        await finish(h)
        nursery.cancel_scope.cancel()


async def test_an_oversized_model_list_is_refused_and_counted() -> None:
    async with trio.open_nursery() as nursery:
        h = await _fleet(nursery, _mixed())
        big = b'{"data": [' + b'{"id": "m"},' * 800_000 + b'{"id": "n"}]}'  # ~9.6 MB
        h.engines["d0"]._models = lambda: big  # type: ignore[method-assign]
        await h.router.health.check_all()
        view = {e["id"]: e for e in (await h.get("/narwhal/engines")).json()["engines"]}
        assert view["d0"]["models_refused"] == 1
        assert {m["id"] for m in view["d0"]["models"]} == {MODEL, "a"}
        await finish(h)
        nursery.cancel_scope.cancel()


async def test_an_alias_that_hides_a_served_name_is_listed_as_the_alias() -> None:
    """``alias-a`` stands for ``a``; an engine that lists its own ``alias-a`` does not
    make the alias mean something else, and /v1/models says what requests get."""
    engines = {**_mixed(), "d1": ("decode", (MODEL, f"alias-a:{MODEL}"))}
    async with trio.open_nursery() as nursery:
        h = await _fleet(nursery, engines)
        listed = {m["id"]: m for m in (await h.get("/v1/models")).json()["data"]}
        assert listed["alias-a"]["root"] == "a"
        assert (await _complete(h, "alias-a")).json()["model"] == "a"
        assert h.router.journal.lines[-1].attempts[0].consumer == "d0"
        await finish(h)
        nursery.cancel_scope.cancel()
