"""One engine as the router sees it: its spec, its in-flight legs, its breaker, its
active health, its last load report and the legs of ours it has not started yet (what
placement and the admission queue read of it), and the operator's view of it."""

from __future__ import annotations

from typing import Any, Literal

from narwhal.core.breaker import Breaker
from narwhal.core.capacity import Capacity
from narwhal.core.config import EngineSpec, RecoveryConfig
from narwhal.core.engine_report import EngineReport
from narwhal.core.flow import Saturation, room_left
from narwhal.core.lora_slots import RecentAdapters
from narwhal.core.served_models import Served

# the two legs of an attempt; an engine serves either, as its role allows
Leg = Literal["prefill", "decode"]
LEGS: tuple[Leg, ...] = ("prefill", "decode")
HEALTH_FAILS_TO_LEAVE = 2  # one lost check is a hiccup; two in a row, the engine is gone
WAITING_SHARE = 0.25  # an engine may queue this share of what it runs at once (waiting_limit)
# its capacity is the most it ran at once over its last reports (5 minutes at the default
# metrics_interval_s), grown while it never held a request back (core/capacity.py): a
# report that lied, or a load it no longer takes, drops out
CAPACITY_REPORTS = 300
MAX_CAPACITY = 4096.0  # a report of more running at once is clamped (vLLM's default is 1024)


class EngineState:
    __slots__ = (
        "adapters",
        "breaker",
        "capacity",
        "capacity_seen",
        "checked_at",
        "decodes_running",
        "decodes_running_peak",
        "decodes_started",
        "decodes_started_at_mark",
        "decoding",
        "decoding_at_mark",
        "failed_as",
        "failed_with",
        "health_failures",
        "inflight",
        "inflight_gauges",
        "mark",
        "models_refused",
        "prefilling",
        "prefilling_at_mark",
        "report",
        "scrape_failures",
        "sent",
        "served",
        "spec",
        "up",
    )

    def __init__(self, spec: EngineSpec, recovery: RecoveryConfig) -> None:
        self.spec = spec
        self.inflight: dict[Leg, int] = {"prefill": 0, "decode": 0}
        self.inflight_gauges: dict[Leg, Any] = {}  # Prometheus children, when exported
        self.breaker = Breaker(recovery.eject_after, recovery.failure_quarantine_s)
        # the leg of its last counted failure, and the peer of that attempt: a consumer
        # that failed a crossed decode is probed with a handoff from that same producer
        self.failed_as: Leg | None = None
        self.failed_with: str | None = None
        # active health (contract 3, /ready): placeable only once it answered /health, and no
        # longer after HEALTH_FAILS_TO_LEAVE checks in a row went unanswered
        self.up = False
        self.health_failures = 0
        self.checked_at: float | None = None
        # its own account of its load, from its /metrics (placement.metrics_interval_s)
        self.report: EngineReport | None = None
        # the requests it runs at once, learned from its reports: the most it has run at
        # once over its last reports (a lower bound: a leg sent within it starts at once;
        # None: no report yet).
        # Not only while some waited: a consumer that never queues would never show it,
        # and its room would be its waiting limit alone, however many streams it runs
        self.capacity: float | None = None
        self.capacity_seen = Capacity(CAPACITY_REPORTS, MAX_CAPACITY, WAITING_SHARE)
        self.scrape_failures = 0  # in a row; a scrape never moves the breaker
        # the LoRA adapters placed on it or seen running there: what its idle adapter slots
        # hold, which its report does not list (placement's adapter affinity)
        self.adapters = RecentAdapters()
        # the names it serves, from its last good /v1/models (None: it never gave one, and
        # serves the fleet's model); lists refused since it was added
        self.served: Served | None = None
        self.models_refused = 0
        # This router's legs to it that it has not started (contract 4.5), the queue a report
        # cannot show yet or shows late (vLLM's gauges trail its requests by an engine
        # step or more). A decode has started at its first token: every decode before it
        # counts (``decoding``), and the report's waiting queue counts only beyond the ones
        # it may hold already (``decoding_at_mark``, when its scrape went out). A prefill
        # shows no start, only its end: those sent since the scrape went out count
        # (numbered as sent; ``prefilling`` holds the numbers of those not ended, ``mark``
        # how many had been sent when the scrape went out).
        self.decoding = 0
        self.decoding_at_mark = 0
        self.sent = 0
        self.prefilling: set[int] = set()
        self.mark = 0
        # our prefills not ended when the scrape went out: those that end after it are
        # still in its running count, and leave the engine room it does not show
        self.prefilling_at_mark = 0
        # our decodes that reached their first token, ever and when the scrape went out:
        # those since run in slots its report still shows free
        self.decodes_started = 0
        self.decodes_started_at_mark = 0
        # our decodes it runs now (started, not ended), and the most since its last report:
        # a bound on its capacity known at once, where a report shows it an interval late
        # (a consumer a fresh router sends streams to ran them long before a scrape said so)
        self.decodes_running = 0
        self.decodes_running_peak = 0

    def scrape_mark(self) -> tuple[int, int, int, int, int]:
        """What the scrape going out now may count of ours, and the adapters placed before
        it (for ``note_report``)."""
        prefilling = len(self.prefilling)
        return self.sent, self.decoding, self.adapters.clock, prefilling, self.decodes_started

    def decode_started(self) -> None:
        """Our decode reached its first token: it runs here."""
        self.decoding -= 1
        self.decodes_started += 1
        self.decodes_running += 1
        if self.decodes_running > self.decodes_running_peak:
            self.decodes_running_peak = self.decodes_running
            self.capacity = self.capacity_seen.ours(self.decodes_running)

    def decode_ended(self) -> None:
        """Our decode that had started here has ended. The slot it took since a scrape
        still counts until the next one: a real consumer shows the decodes a burst into
        freed slots sends it as waiting while they pull their KV (a second or more on the
        CPU engine), and a consumer with ``--max-num-seqs 2`` then queued two under a limit
        of one."""
        self.decodes_running -= 1

    def note_report(
        self,
        report: EngineReport | None,
        mark: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0),
    ) -> None:
        """A new account of its load, from a scrape sent at ``mark`` (``scrape_mark``);
        None: scraping stopped, and every leg not started counts again."""
        self.report = report
        sent, decoding, placed, prefilling, started = mark
        self.mark, self.decoding_at_mark = (sent, decoding) if report is not None else (0, 0)
        if report is not None:
            peak = self.decodes_running_peak
            self.capacity = self.capacity_seen.note(report.running, report.waiting, peak)
            self.decodes_running_peak = self.decodes_running
        self.prefilling_at_mark = prefilling if report is not None else 0
        self.decodes_started_at_mark = started if report is not None else self.decodes_started
        if report is not None and report.lora is not None:
            self.adapters.seen_running(report.lora.running, placed)

    @property
    def pending(self) -> int:
        """This router's legs it has not started and its last report may not show: every
        decode before its first token, the prefills sent since the scrape went out."""
        mark = self.mark
        return self.decoding + sum(1 for number in self.prefilling if number > mark)

    def _ours(self, fresh: bool) -> int:
        """Our legs not started that count: without a fresh report, every one."""
        return self.pending if fresh else self.decoding + len(self.prefilling)

    def _others_waiting(self, report: EngineReport) -> float:
        """The report's waiting queue less what of it may be our own decodes."""
        return max(0.0, report.waiting - self.decoding_at_mark)

    def room(
        self, now: float, interval_s: float, waiting_limit: int, kv_limit: float, leg: Leg
    ) -> tuple[int, Saturation | None]:
        """How many more legs it takes before it is saturated, and why it is, for ``leg``."""
        report = self.report
        fresh = report is not None and report.fresh(now, interval_s)
        return room_left(
            self._others_waiting(report) if fresh and report is not None else None,
            self._ours(fresh),
            report.kv_usage if fresh and report is not None else None,
            waiting_limit=self.waiting_limit(waiting_limit),
            kv_limit=kv_limit,
            consumer=leg == "decode",
            free=self._free(report) if fresh and report is not None else 0.0,
        )

    def waiting_limit(self, configured: int) -> int:
        """The queue it may be predicted to have before it is saturated: ``configured``
        (``engine_waiting_limit``), or a share of what it runs at once when that is more.
        Legs not started count as waiting, and a consumer that runs a hundred streams has
        a pipeline of KV pulls and of requests in prefill (each holds its room) far longer
        than two: a fixed limit held requests in the router while the engines had room,
        and what they ran never grew past what the queue let through."""
        capacity = self.capacity or 0.0
        return max(configured, int(capacity * WAITING_SHARE))

    def _free(self, report: EngineReport) -> float:
        """The room it has free by its report: its learned capacity less what it ran then,
        less our prefills it ran then that have ended since (a scrape is up to an interval
        old, and a short prefill ends well within it), less our decodes that started since
        (they run in slots the report shows free; those that ended since still count until
        the next report, ``decode_ended``: the room is never overstated)."""
        if self.capacity is None:
            return 0.0
        mark = self.mark
        still = sum(1 for number in self.prefilling if number <= mark)
        ended = max(0, self.prefilling_at_mark - still)
        started = self.decodes_started - self.decodes_started_at_mark
        running = max(0.0, report.running - ended) + started
        return max(0.0, self.capacity - running)

    def queued(self, now: float, interval_s: float) -> float:
        """How many of the requests there must end before one more starts (the cost
        model's queue ahead): what its fresh report ran and held that was not ours, plus
        our legs there now (ours as we know them now, not as the scrape saw them: a
        scrape is up to an interval old), beyond its learned capacity. Without a fresh
        report, our legs it has not started."""
        report = self.report
        if report is None or not report.fresh(now, interval_s) or self.capacity is None:
            return float(self._ours(False))
        others = max(0.0, report.running + report.waiting - report.ours)
        return max(0.0, others + self.load + 1 - max(self.capacity, 1.0))

    def running(self, now: float, interval_s: float) -> float:
        """The requests it runs: its fresh report's count, else this router's started legs."""
        report = self.report
        if report is not None and report.fresh(now, interval_s):
            return report.running
        return max(0, self.load - self.decoding - len(self.prefilling))

    def note_health(self, ok: bool, now: float) -> str | None:
        """Record one active health check; the transition it caused ("joined", "left")."""
        self.checked_at = now
        if ok:
            self.health_failures = 0
            if not self.up:
                self.up = True
                return "joined"
            return None
        self.health_failures += 1
        if self.up and self.health_failures >= HEALTH_FAILS_TO_LEAVE:
            self.up = False
            return "left"
        return None

    def saturation(
        self, now: float, interval_s: float, waiting_limit: int, kv_limit: float
    ) -> Saturation | None:
        """Why it takes no more legs of any role it serves now, or None."""
        legs = [leg for leg, able in zip(LEGS, self._serves(), strict=True) if able]
        for leg in legs:
            _, why = self.room(now, interval_s, waiting_limit, kv_limit, leg)
            if why is not None:
                return why
        return None

    def saturation_view(
        self, now: float, interval_s: float, waiting_limit: int, kv_limit: float
    ) -> dict[str, object]:
        """The operator's view of its saturation (``/narwhal/engines``)."""
        report = self.report
        fresh = report is not None and report.fresh(now, interval_s)
        return {
            "saturated": self.saturation(now, interval_s, waiting_limit, kv_limit),
            "waiting_scraped": report.waiting if fresh and report is not None else None,
            "ours_not_started": self._ours(fresh),
            # the requests it runs at once, as its reports showed (None: no report yet)
            "capacity": self.capacity,
            "waiting_limit": self.waiting_limit(waiting_limit),
        }

    def _serves(self) -> tuple[bool, bool]:
        return self.spec.can_prefill, self.spec.can_decode

    @property
    def id(self) -> str:
        return self.spec.id

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def load(self) -> int:
        return self.inflight["prefill"] + self.inflight["decode"]

    def snapshot(self, now: float, held_in: bool, interval_s: float = 0.0) -> dict[str, object]:
        """The operator's view (``/narwhal/engines``); times are seconds from ``now``."""
        b = self.breaker
        return {
            "id": self.id,
            "url": self.url,
            "role": self.spec.role,
            "inflight": dict(self.inflight),
            "breaker": {
                "state": b.state.value,
                "streak": b.streak,
                "last_cause": b.last_cause,
                "ejection_cause": b.ejection_cause.value if b.ejection_cause else None,
                "ejections": b.ejections,
            },
            # an ejected engine stays out until a probe passes: no fixed end time
            "ejected_until": "probe" if b.state.value != "closed" else None,
            "ejected_for_s": None if b.ejected_at is None else round(now - b.ejected_at, 3),
            "quarantined_for_s": round(max(0.0, b.quarantined_until - now), 3) or None,
            "held_in": held_in,
            "up": self.up,
            "health_failures": self.health_failures,
            "last_health_ago_s": None
            if self.checked_at is None
            else round(now - self.checked_at, 3),
            "report": None if self.report is None else self.report.view(now, interval_s),
            "scrape_failures": self.scrape_failures,
            "models": None if self.served is None else self.served.view(),
            "models_refused": self.models_refused,
            "last_probe": b.last_probe,
            "last_probe_ago_s": None
            if b.last_probe_at is None
            else round(now - b.last_probe_at, 3),
        }
