"""The fake engine's models and LoRA adapters, sans I/O: what it serves and what is loaded.

As ``vllm serve BASE --served-model-name ... --enable-lora --lora-modules name=DIR ...``:
``Catalog`` holds the served names (``--models base,lora-a:base``: a name alone is the base
model, the first such one; ``name:parent`` is an adapter of ``parent``), ``AdapterSlots``
the ``--max-loras`` adapter slots and the queue of requests that wait for one, and
``InfoSeries`` the ``vllm:lora_requests_info`` gauge that reports them.

Slots, as vLLM's scheduler and LoRA manager use them: a request for an adapter that is
loaded runs at once; one for an adapter that is not takes a free slot, or else the slot of
the least recently used adapter no request is running on (a swap: the adapter is evicted,
the new one loaded); when every slot's adapter is running a request it waits, in FIFO order
among the requests that need a slot, and is listed in ``waiting_lora_adapters``. A load
costs ``--lora-swap-ms`` (the engine sleeps, this module only decides). As in vLLM, requests
for a busy loaded adapter keep it loaded however long others wait. The base model (and its
aliases) needs no slot.
"""

from __future__ import annotations

import argparse
import itertools
import zlib
from collections import Counter, OrderedDict
from collections.abc import Sequence
from typing import Any, NamedTuple

from narwhal.fake_engine.cost import non_negative

# the swap time with the cost model on and no --lora-swap-ms: an adapter of rank 8 copied
# from vLLM's CPU cache into a GPU slot (a few MiB), plus the step it is scheduled in
DEFAULT_COST_SWAP_MS = 20.0
_KEEP_SERIES = 16  # label sets of vllm:lora_requests_info kept once they are old


class Model(NamedTuple):
    """One served name: the base model or an alias of it (``parent`` None, ``lora_id`` 0),
    or an adapter (``lora_id`` from 1, in the order given: vLLM's ``lora_int_id``)."""

    name: str
    parent: str | None
    lora_id: int


class Catalog:
    """The names an engine serves, from ``--models`` entries (``name`` or ``name:parent``)."""

    def __init__(self, entries: Sequence[str]) -> None:
        self.models: dict[str, Model] = {}
        adapters = 0
        for entry in entries:
            name, _, parent = (part.strip() for part in entry.partition(":"))
            if not name or (":" in entry and not parent):
                raise ValueError(f"a model is `name` or `name:parent`, got {entry!r}")
            if name in self.models:
                raise ValueError(f"model {name!r} is given twice")
            if parent:
                adapters += 1
            self.models[name] = Model(name, parent or None, adapters if parent else 0)
        self.aliases = tuple(m.name for m in self.models.values() if m.parent is None)
        if not self.aliases:
            raise ValueError("the models need a base model (a name without a parent)")
        self.base = self.aliases[0]
        self.adapters = tuple(m.name for m in self.models.values() if m.parent is not None)
        for name in self.adapters:
            of = self.models[name].parent
            if of not in self.aliases:
                raise ValueError(f"adapter {name!r}: its parent {of!r} is no base model")

    def serves(self, name: object) -> bool:
        return isinstance(name, str) and name in self.models

    def adapter(self, name: str) -> str | None:
        """The adapter a served name runs under (None: the base model's weights)."""
        return name if self.models[name].parent is not None else None

    def weights(self, name: str) -> str:
        """What KV computed for ``name`` is valid for: the adapter, or the base model for
        the base and its aliases (one set of weights under several names)."""
        return self.adapter(name) or self.base

    def not_found(self, name: object) -> str:
        """vLLM's 404 message for a model it does not serve (tests/captures/err_model.txt)."""
        return f"The model `{name}` does not exist. Valid aliases: {', '.join(self.aliases)}."


class Grant(NamedTuple):
    """A request's adapter is now in a slot: ``load``, it was not and the request pays
    the load; ``evicted``, the adapter whose slot it took (a swap)."""

    load: bool
    evicted: str | None


class AdapterSlots:
    """``max_loras`` adapter slots and the requests waiting for one (see the module)."""

    def __init__(self, max_loras: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be 1 or more, got {max_loras}")
        self.max_loras = max_loras
        self.loaded: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self.running: Counter[str] = Counter()  # admitted requests per adapter
        self.waiting: dict[int, str] = {}  # ticket -> adapter, in arrival order
        self.loads: Counter[str] = Counter()
        self.swaps = 0
        self._tickets = itertools.count()

    def arrive(self, adapter: str) -> int:
        """A request for ``adapter`` joins the queue; its ticket for ``admit``."""
        ticket = next(self._tickets)
        self.waiting[ticket] = adapter
        return ticket

    def admit(self, ticket: int) -> Grant | None:
        """Run the request now, or None while it must wait (then retry after any change)."""
        adapter = self.waiting[ticket]
        if adapter in self.loaded:
            return self._run(ticket, Grant(load=False, evicted=None))
        for earlier, wanted in self.waiting.items():
            if earlier == ticket:
                break
            if wanted not in self.loaded:
                return None  # an earlier request needs a slot first (FIFO)
        evicted = None
        if len(self.loaded) >= self.max_loras:
            idle = [name for name in self.loaded if not self.running[name]]
            if not idle:
                return None
            evicted = idle[0]
            del self.loaded[evicted]
            self.swaps += 1
        self.loaded[adapter] = None
        self.loads[adapter] += 1
        return self._run(ticket, Grant(load=True, evicted=evicted))

    def _run(self, ticket: int, grant: Grant) -> Grant:
        adapter = self.waiting.pop(ticket)
        self.running[adapter] += 1
        self.loaded.move_to_end(adapter)
        return grant

    def leave(self, ticket: int) -> None:
        """A waiting request is gone (its client left)."""
        del self.waiting[ticket]

    def release(self, adapter: str) -> None:
        """An admitted request has finished; its adapter stays loaded, most recently used."""
        self.running[adapter] -= 1
        if not self.running[adapter]:
            del self.running[adapter]
        self.loaded.move_to_end(adapter)

    def labels(self) -> tuple[str, str]:
        """``running_lora_adapters`` and ``waiting_lora_adapters``: comma-joined, sorted."""
        running = ",".join(sorted(self.running))
        return running, ",".join(sorted(set(self.waiting.values())))

    def stats(self) -> dict[str, Any]:
        return {
            "max_loras": self.max_loras,
            "loaded": list(self.loaded),
            "lora_swaps": self.swaps,
            "lora_loads": dict(self.loads),
        }


class InfoSeries:
    """``vllm:lora_requests_info``: one gauge whose labels are the state and whose value is
    the unix time they were last current. vLLM sets the current label set to the time at
    every step, and a label set it no longer sets lingers with its last time; so the
    newest value is the current one. A scrape gives the current set the scrape's time (at
    least a microsecond past every older set's), older sets the time they were left."""

    def __init__(self, max_loras: int, now: float) -> None:
        self.max_loras = max_loras
        self.current = ("", "")
        self.since = now
        self.past: OrderedDict[tuple[str, str], float] = OrderedDict()

    def note(self, labels: tuple[str, str], now: float) -> None:
        """The state is ``labels`` from ``now`` on."""
        if labels == self.current:
            return
        self.past[self.current] = now
        self.past.move_to_end(self.current)
        self.past.pop(labels, None)
        while len(self.past) > _KEEP_SERIES:
            self.past.popitem(last=False)
        self.current, self.since = labels, now

    def lines(self, now: float) -> list[str]:
        """The exposition, as prometheus_client writes it (labels sorted, Go floats)."""
        out = [
            "# HELP vllm:lora_requests_info Running stats on lora requests.",
            "# TYPE vllm:lora_requests_info gauge",
        ]
        series = [*self.past.items(), (self.current, max(now, self.since + 1e-6))]
        for (running, waiting), value in series:
            out.append(
                f'vllm:lora_requests_info{{max_lora="{self.max_loras}",'
                f'running_lora_adapters="{running}",waiting_lora_adapters="{waiting}"}} '
                + go_float(value)
            )
        return out


def go_float(value: float) -> str:
    """A float as prometheus_client writes it (Go's notation: ``1.7e+09``)."""
    text = repr(float(value))
    dot = text.find(".")
    if value > 0 and dot > 6:
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+0{dot - 1}"
    return text


def generation_salt(adapter: str, key: int | None) -> int:
    """The generation key of a sample under ``adapter`` (``asks.Ask.key``): a function
    of the adapter's name and of the base model's key for the sample, so an adapter says
    something else than the base model, deterministically."""
    return zlib.crc32(f"lora {adapter} {key}".encode())


# ---- the command line (``narwhal fake-engine``) ----------------------------------------------


def _models(text: str) -> tuple[str, ...]:
    entries = tuple(part.strip() for part in text.split(",") if part.strip())
    try:
        Catalog(entries)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return entries


def _slots(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--models``, ``--max-loras`` and ``--lora-swap-ms``."""
    parser.add_argument(
        "--models",
        type=_models,
        default=(),
        help="served names, comma-separated: the first name alone is the base model (others "
        "alone: its aliases), name:parent an adapter of parent, e.g. base,sql:base "
        "(default: --model alone)",
    )
    parser.add_argument(
        "--max-loras",
        type=_slots,
        default=1,
        help="adapters loaded at once, as vLLM's --max-loras: another one is swapped in for "
        "the least recently used idle one, or waits",
    )
    parser.add_argument(
        "--lora-swap-ms",
        type=non_negative,
        default=None,
        help="how long loading an adapter takes, in ms (default: 0, or "
        f"{DEFAULT_COST_SWAP_MS:g} with the cost model on)",
    )


def config_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The ``FakeEngineConfig`` fields the options above set."""
    return {"models": args.models, "max_loras": args.max_loras, "lora_swap_ms": args.lora_swap_ms}
