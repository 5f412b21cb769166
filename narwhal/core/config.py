"""The fleet file's sections: frozen msgspec structs whose annotations carry each key's
rule, and the error that lists a file's problems.

``narwhal.core.config_parse`` reads a file's bytes into them, reporting every problem at
once; ``narwhal.core.config_rules`` holds the rules that no annotation can say.
"""

from __future__ import annotations

from typing import Annotated, Literal, TypeAlias, cast

from msgspec import Meta, Struct

Role: TypeAlias = Literal["prefill", "decode", "both"]
RestartPolicy: TypeAlias = Literal["individual", "whole_wave"]

PositiveFloat = Annotated[float, Meta(gt=0)]
NonNegativeFloat = Annotated[float, Meta(ge=0)]
PositiveInt = Annotated[int, Meta(ge=1)]
NonNegativeInt = Annotated[int, Meta(ge=0)]
NonEmptyStr = Annotated[str, Meta(min_length=1)]


class _Roles:
    """What an engine of ``role`` may serve (a mixin of the structs with a ``role``)."""

    __slots__ = ()
    role: Role

    @property
    def can_prefill(self) -> bool:
        return self.role != "decode"

    @property
    def can_decode(self) -> bool:
        return self.role != "prefill"


class EngineSpec(Struct, _Roles, frozen=True, forbid_unknown_fields=True):
    id: NonEmptyStr
    url: NonEmptyStr
    role: Role = "both"
    # its KV-event publisher ("tcp://host:port"); "" = from the engine or [kv_events]
    kv_events: str = ""


class ServingConfig(Struct, frozen=True, forbid_unknown_fields=True):
    request_timeout_s: PositiveFloat = 600.0
    prefill_timeout_s: PositiveFloat = 120.0
    handoff_timeout_s: NonNegativeFloat = 0.0
    max_attempts: Annotated[int, Meta(ge=1, le=5)] = 1
    retry_budget: NonNegativeFloat = 10.0
    retry_replenish: NonNegativeFloat = 0.1
    retry_backoff_s: NonNegativeFloat = 0.05
    max_inflight: PositiveInt = 1024
    max_request_bytes: PositiveInt = 4 * 1024 * 1024
    api_keys_env: str = ""
    admin_keys_env: str = ""  # admin keys for /narwhal/*; "" = loopback peers only
    graceful_timeout_s: NonNegativeFloat = 30.0
    max_fanout: PositiveInt = 16  # most engine requests one client request fans out to
    client_idle_timeout_s: PositiveFloat = 20.0  # above aiohttp's 15 s and httpx's 5 s idle expiry
    client_body_timeout_s: PositiveFloat = 30.0


LEASE_SLACK = 0.05  # of the KV lease, kept unused at its end
DEFAULT_KV_LEASE_S = 30.0  # vLLM 0.32's kv_lease_duration default (contract 2)


class EngineConfig(Struct, frozen=True, forbid_unknown_fields=True):
    first_token_timeout_s: PositiveFloat = 2.5
    decode_read_timeout_s: NonNegativeFloat = 10.0
    connect_timeout_s: PositiveFloat = 5.0
    health_timeout_s: PositiveFloat = 5.0
    api_key_env: str = ""
    max_connections: PositiveInt = 512
    ca_file: str = ""  # CA bundle for https:// engines; "" = the system trust store
    health_interval_s: PositiveFloat = 5.0  # active /health of every engine, idle or not
    # the producers' lease: vLLM 0.32's kv_lease_duration (30 s unless the engines set it;
    # VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s, before). A default above the engines' would
    # send descriptors whose blocks are already freed: a wrong answer with no error
    kv_lease_s: PositiveFloat = DEFAULT_KV_LEASE_S
    reclaim_orphans: bool = True

    @property
    def lease_limit_s(self) -> float:
        """The oldest a KV descriptor may be when it is sent to a consumer (contract 5).

        What counts is the age at the send: once a vLLM 0.32 consumer holds the request,
        its heartbeats extend the producer's lease until it reads the blocks. The slack
        covers the producer's clock starting after ours and the way to the consumer."""
        return self.kv_lease_s * (1 - LEASE_SLACK)


class RecoveryConfig(Struct, frozen=True, forbid_unknown_fields=True):
    eject_after: PositiveInt = 3
    failure_quarantine_s: NonNegativeFloat = 0.0
    readmit_interval_s: PositiveFloat = 10.0
    restart_policy: RestartPolicy = "individual"
    # > 0: a stream that fails after output continues on another consumer (contract 6.4), at
    # most this many times per request
    resume_streams: NonNegativeInt = 0


class EngineContract(Struct, frozen=True, forbid_unknown_fields=True):
    engine_version: NonEmptyStr
    connector: Literal["NixlConnector"] = "NixlConnector"
    kv_lease_s: PositiveFloat | None = None  # the engines' lease, when the operator pins it


class DiscoverBlock(Struct, _Roles, frozen=True, forbid_unknown_fields=True):
    """Engines from DNS: every A/AAAA record of ``dns`` is one engine at ``port``."""

    name: NonEmptyStr  # discovered engine ids are "<name>/<ip>:<port>"
    dns: NonEmptyStr
    port: Annotated[int, Meta(ge=1, le=65535)] = 8000
    role: Role = "both"
    scheme: Literal["http", "https"] = "http"


class PlacementConfig(Struct, frozen=True, forbid_unknown_fields=True):
    """Which engine takes a leg (contract 4.4)."""

    # "predicted": one cost model decides placement and local-versus-P/D (docs/contract.md 4.8)
    policy: Literal["least_loaded", "round_robin", "predicted"] = "least_loaded"
    metrics_interval_s: NonNegativeFloat = 1.0  # scrape of each engine's /metrics; 0 = off
    prefix_affinity: bool = True  # producers chosen by prompt prefix, bounded by load
    # a producer may carry this times the mean load before its keys spill to the next
    affinity_load_factor: Annotated[float, Meta(ge=1.0)] = 1.25
    # > 0: conditional disaggregation (decode first): a prompt whose part not cached on its
    # consumer is estimated below this many tokens is prefilled by the consumer itself
    local_prefill_tokens: NonNegativeInt = 0
    # also prefill on the consumer when every producer is saturated and the consumer is not
    local_prefill_when_busy: bool = False
    # how long the router trusts that an engine still caches a prefix it sent there
    prefix_index_ttl_s: PositiveFloat = 120.0
    # a request for a LoRA adapter prefers engines that have it loaded, then engines with a
    # free adapter slot (their vllm:lora_requests_info), before the load and prefix rules
    adapter_affinity: bool = True


Priority: TypeAlias = Literal["interactive", "default", "batch"]


class ClassTargets(Struct, frozen=True, forbid_unknown_fields=True):
    """A class's latency targets (``[admission.classes.<name>]``); None: no target."""

    # a request that cannot meet it even with nothing queued ahead is refused at once
    ttft_slo_s: PositiveFloat | None = None
    # plans whose predicted time per output token exceeds it are not chosen
    tpot_slo_s: PositiveFloat | None = None


class AdmissionConfig(Struct, frozen=True, forbid_unknown_fields=True):
    """Flow control (contract 4.5): what the router holds while the fleet is saturated."""

    queue: bool = True  # false: dispatch at once, the engines' queues take the burst
    max_queued: PositiveInt = 4096
    max_queue_wait_s: NonNegativeFloat = 30.0  # never past the request's deadline
    # an engine is saturated when its scraped waiting queue, plus this router's legs sent to
    # it since that scrape and not yet started, reaches this ...
    engine_waiting_limit: PositiveInt = 2
    kv_usage_limit: Annotated[float, Meta(gt=0, le=1)] = 0.95  # ... or, for a consumer, this
    priority_from: Literal["header", "key"] = "header"
    default_class: Priority = "default"
    classes: dict[Priority, ClassTargets] = {}

    def targets(self, cls: str) -> ClassTargets:
        """The class's targets (none set: no target)."""
        return self.classes.get(cast(Priority, cls), NO_TARGETS)


NO_TARGETS = ClassTargets()


class PredictionConfig(Struct, frozen=True, forbid_unknown_fields=True):
    """The cost model of policy "predicted": priors until ``min_samples`` legs of an
    engine (or a pair) have been seen, and how fast old samples fade."""

    prefill_tokens_per_s: PositiveFloat = 8000.0
    decode_step_s: PositiveFloat = 0.03
    transfer_mib_per_s: PositiveFloat = 1000.0
    min_samples: PositiveInt = 20
    half_life_s: PositiveFloat = 300.0  # older samples weigh half as much after this long


class KvEventsConfig(Struct, frozen=True, forbid_unknown_fields=True):
    """The precise prefix index: what each engine caches, from its own KV events."""

    # "subscribe": connect to each engine's publisher; "listen": bind ``listen``, engines'
    # publishers connect to it; "off": the approximate index only
    mode: Literal["off", "subscribe", "listen"] = "off"
    port: Annotated[int, Meta(ge=1, le=65535)] = 5557  # an engine's publisher, by default
    listen: str = "tcp://127.0.0.1:5557"
    replay: bool = True  # ask an engine's replay endpoint for the batches a gap lost
    # "engine": a request's token ids from the engine's own POST /tokenize
    tokenizer: NonEmptyStr = "engine"


class DiscoveryConfig(Struct, frozen=True, forbid_unknown_fields=True):
    interval_s: PositiveFloat = 5.0  # re-resolve period
    nameserver: str = ""  # "ip" or "ip:port" ("[v6]:port"); "" = the system resolver


class FleetConfig(Struct, frozen=True, forbid_unknown_fields=True):
    model: NonEmptyStr
    engines: tuple[EngineSpec, ...] = ()  # may be empty when [[discover]] finds engines
    discover: tuple[DiscoverBlock, ...] = ()
    discovery: DiscoveryConfig = DiscoveryConfig()
    serving: ServingConfig = ServingConfig()
    engine: EngineConfig = EngineConfig()
    recovery: RecoveryConfig = RecoveryConfig()
    placement: PlacementConfig = PlacementConfig()
    admission: AdmissionConfig = AdmissionConfig()
    kv_events: KvEventsConfig = KvEventsConfig()
    prediction: PredictionConfig = PredictionConfig()
    engine_contract: EngineContract | None = None
    # a client's model name -> the served name it stands for (a base model or an adapter)
    aliases: dict[str, str] = {}


class ConfigError(Exception):
    """A fleet file that cannot be used; ``problems`` holds one ``path: rule`` per fault."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        super().__init__(self.render())

    def render(self) -> str:
        lines = [f"invalid fleet file {self.source}: {len(self.problems)} problem(s)"]
        lines += [f"  {p}" for p in self.problems]
        return "\n".join(lines)
