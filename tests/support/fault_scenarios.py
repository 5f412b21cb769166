"""The catalogue of single-engine faults: the failure tests, the fault table and the
later fault matrix all break engines the same named ways.

Each entry: which leg breaks (the producer's or the consumer's) and the scripted fault,
or None for a stopped engine (connection refused).
"""

from __future__ import annotations

from typing import Literal

from narwhal.fake_engine.faults import Fault

Side = Literal["producer", "consumer"]

FAULTS: dict[str, tuple[Side, Fault | None]] = {
    "prefill 500": ("producer", Fault(kind="status", status=500)),
    "prefill 503": ("producer", Fault(kind="status", status=503)),
    "prefill 400": ("producer", Fault(kind="status", status=400)),
    "prefill 408": ("producer", Fault(kind="status", status=408)),
    "prefill 429": ("producer", Fault(kind="status", status=429)),
    "prefill hang": ("producer", Fault(kind="hang")),
    "no descriptor": ("producer", Fault(kind="no_descriptor")),
    "empty engine id": ("producer", Fault(kind="bad_engine_id", value="")),
    "non-string engine id": ("producer", Fault(kind="bad_engine_id", value=7)),
    "malformed block ids": ("producer", Fault(kind="bad_block_ids", value=[[1, -2]])),
    "prefill reset mid-body": ("producer", Fault(kind="close_mid_body")),
    "producer stopped": ("producer", None),
    "decode 503": ("consumer", Fault(kind="status", status=503)),
    "decode hang": ("consumer", Fault(kind="hang", leg="decode")),
    "headers then nothing": ("consumer", Fault(kind="headers_then_silence")),
    "metadata then silence": ("consumer", Fault(kind="metadata_then_silence")),
    "tokens then silence": ("consumer", Fault(kind="tokens_then_silence", tokens=2)),
    "tokens then close": ("consumer", Fault(kind="tokens_then_close", tokens=2)),
    "[DONE] before a token": ("consumer", Fault(kind="done_first")),
    "in-stream 503 first": ("consumer", Fault(kind="stream_error", code=503)),
    "in-stream 429 after tokens": ("consumer", Fault(kind="stream_error", code=429, tokens=2)),
    "in-stream error without code": ("consumer", Fault(kind="stream_error", code=None, tokens=1)),
    "malformed chunk": ("consumer", Fault(kind="malformed_chunk")),
    "oversized event after tokens": ("consumer", Fault(kind="oversized_event", tokens=2)),
    "slow drip inside the limits": ("consumer", Fault(kind="slow_drip", interval_s=0.1)),
    "consumer stopped": ("consumer", None),
}
