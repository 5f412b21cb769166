"""The fake engines' KV side channel: a producer holds blocks under a lease, a consumer pulls.

It stands in for NIXL's side channel (``remote_host``/``remote_port`` in the descriptor):
the consumer really connects to the producer the descriptor names and asks for the
blocks, so a reused, expired, never-issued or forged descriptor fails on the consumer the
way a real transfer would, and both sides count it. A lease remembers the weights its KV was
computed under (the base model, or a LoRA adapter: ``Catalog.weights``) and a pull for a
request of other weights is refused (``wrong_model``): a real engine would read KV of other
weights without an error and generate garbage; the fake fails the decode instead, so a
handoff across adapters is visible. Wire format: one JSON object per line
each way, on kept-alive TCP connections.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import trio

PULL_TIMEOUT_S = 5.0  # vLLM's NIXL handshake gives up after 5 s
_REMEMBER_RELEASED = 100_000


class Lease(msgspec.Struct):
    request_id: str
    block_ids: list[list[int]]
    expires_at: float
    origin: str = ""  # the x-request-id of the prefill leg that produced it
    # its descriptor went out intact in a whole response: a router holds a valid handoff
    # for these blocks, and only a decode or a reclaim (or the lease) frees them
    delivered: bool = False
    model: str = ""  # the weights the KV was computed under (``Catalog.weights``)


class PullRequest(msgspec.Struct):
    engine_id: str
    request_id: str
    block_ids: Any
    consumer: str
    # no transfer: the consumer refused the request before admission and tells the
    # producer to free the blocks (vLLM's notice since vllm#41269)
    release_only: bool = False
    model: str = ""  # the weights the consumer decodes under (``Catalog.weights``)


class PullReply(msgspec.Struct):
    ok: bool
    reason: str = ""
    blocks: int = 0


class KVStore:
    """The producer side: leases by remote request id."""

    def __init__(self, engine_id: str, lease_s: float, counters: dict[str, int]) -> None:
        self.engine_id = engine_id
        self.lease_s = lease_s
        self.counters = counters
        self.leases: dict[str, Lease] = {}
        self.released: OrderedDict[str, str] = OrderedDict()  # request id -> consumer
        self._next_block = itertools.count(1)
        self.events: list[dict[str, Any]] = []

    def issue(
        self,
        request_id: str,
        prompt_tokens: int,
        block_size: int = 16,
        *,
        origin: str = "",
        model: str = "",
    ) -> Lease:
        self.expire()
        count = max(1, -(-prompt_tokens // block_size))
        lease = Lease(
            request_id,
            [[next(self._next_block) for _ in range(count)]],
            trio.current_time() + self.lease_s,
            origin,
            model=model,
        )
        self.leases[request_id] = lease
        self.counters["kv_leases_issued"] += 1
        return lease

    def expire(self) -> None:
        now = trio.current_time()
        while self.leases:
            first = next(iter(self.leases.values()))
            if first.expires_at > now:
                break
            del self.leases[first.request_id]
            self._remember(first.request_id, "<expired>")
            self.counters["kv_leases_expired"] += 1

    def pull(self, req: PullRequest) -> PullReply:
        self.expire()
        reason = self._refusal(req)
        if reason:
            # a release (a reclaim's, no transfer) is counted apart from a read: releasing
            # blocks a decode already read is harmless (vLLM ignores a release it cannot
            # match), reading them twice is not
            kind = "kv_release_declined" if req.release_only else "kv_pull_refused"
            self.counters[f"{kind}_{reason}"] += 1
            return PullReply(ok=False, reason=reason)
        lease = self.leases.pop(req.request_id)
        self._remember(req.request_id, req.consumer)
        event = "kv_released_unread" if req.release_only else "kv_released"
        self.counters[event] += 1
        self.events.append({"event": event, "request_id": req.request_id, "consumer": req.consumer})
        del self.events[:-1000]
        return PullReply(ok=True, blocks=0 if req.release_only else self.blocks_of(lease))

    @staticmethod
    def blocks_of(lease: Lease) -> int:
        return sum(len(group) for group in lease.block_ids)

    def delivered(self, request_id: str) -> None:
        """The lease's descriptor reached the client whole and intact."""
        lease = self.leases.get(request_id)
        if lease is not None:
            lease.delivered = True

    def pending(self) -> list[Lease]:
        """Live leases whose descriptor went out intact: KV a router could still have
        decoded or reclaimed, held until the lease runs out otherwise."""
        self.expire()
        return [lease for lease in self.leases.values() if lease.delivered]

    def blocks_held(self) -> int:
        """Blocks under a live lease: KV a producer keeps for a consumer (expired leases
        are freed first, as vLLM reaps them)."""
        self.expire()
        return sum(self.blocks_of(lease) for lease in self.leases.values())

    def _refusal(self, req: PullRequest) -> str:
        if req.engine_id != self.engine_id:
            return "wrong_engine"
        lease = self.leases.get(req.request_id)
        if lease is None:
            holder = self.released.get(req.request_id)
            if holder == "<expired>":
                return "expired"
            return "reused" if holder is not None else "unknown"
        if req.block_ids != lease.block_ids:
            return "forged"
        if req.model != lease.model and not req.release_only:
            return "wrong_model"  # KV of other weights: a real engine would decode garbage
        return ""

    def _remember(self, request_id: str, consumer: str) -> None:
        self.released[request_id] = consumer
        while len(self.released) > _REMEMBER_RELEASED:
            self.released.popitem(last=False)

    async def serve(
        self, host: str, port: int, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
    ) -> None:
        listeners = await trio.open_tcp_listeners(port, host=host)
        try:
            task_status.started(listeners[0].socket.getsockname()[1])
            await trio.serve_listeners(self.serve_stream, listeners)
        finally:
            with trio.CancelScope(shield=True):
                for listener in listeners:
                    await listener.aclose()

    async def serve_stream(self, stream: trio.abc.Stream) -> None:
        reader = _LineReader(stream)
        decode = msgspec.json.Decoder(PullRequest).decode
        try:
            while (line := await reader.readline()) is not None:
                try:
                    reply = self.pull(decode(line))
                except msgspec.MsgspecError:
                    reply = PullReply(ok=False, reason="malformed")
                await stream.send_all(msgspec.json.encode(reply) + b"\n")
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await stream.aclose()


class _LineReader:
    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.buf = b""

    async def readline(self) -> bytes | None:
        while (nl := self.buf.find(b"\n")) < 0:
            data = await self.stream.receive_some(65536)
            if not data:
                return None
            self.buf += data
            if len(self.buf) > 1 << 20:
                return None
        line, self.buf = self.buf[:nl], self.buf[nl + 1 :]
        return line


Connect = Callable[[str, int], Awaitable[trio.abc.Stream]]


class KVPuller:
    """The consumer side: kept-alive connections to each producer's side channel."""

    def __init__(self, connect: Connect | None = None) -> None:
        self._connect: Connect = connect or trio.open_tcp_stream
        self._idle: dict[tuple[str, int], list[_LineReader]] = {}

    async def pull(self, host: str, port: int, req: PullRequest) -> PullReply:
        """Ask the producer for the blocks; a failure to reach it is a refusal too."""
        try:
            with trio.fail_after(PULL_TIMEOUT_S):
                return await self._exchange(host, port, req)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError):
            return PullReply(ok=False, reason="unreachable")
        except msgspec.MsgspecError:
            return PullReply(ok=False, reason="malformed")

    async def _exchange(self, host: str, port: int, req: PullRequest) -> PullReply:
        idle = self._idle.setdefault((host, port), [])
        reader = idle.pop() if idle else _LineReader(await self._connect(host, port))
        try:
            await reader.stream.send_all(msgspec.json.encode(req) + b"\n")
            line = await reader.readline()
            if line is None:
                raise trio.BrokenResourceError("side channel closed")
            reply = msgspec.json.decode(line, type=PullReply)
        except BaseException:
            with trio.CancelScope(shield=True):
                await reader.stream.aclose()
            raise
        idle.append(reader)
        return reply

    async def aclose(self) -> None:
        for readers in self._idle.values():
            for reader in readers:
                with trio.CancelScope(shield=True):
                    await reader.stream.aclose()
        self._idle.clear()
