#!/usr/bin/env python3
"""Which request makes a vLLM NixlConnector producer free an orphaned handoff's KV blocks?

A producer keeps a prefilled request's KV blocks until a consumer reads them (and notifies
it) or the send lease runs out. This probe starts a real producer/consumer pair, prefills
N requests on the producer exactly as the router does, never decodes them, and then, for
each candidate "reclaim" request, measures how fast the producer's KV usage returns to its
idle level, what the reclaim request costs the consumer, and what the logs say.

    python e2e/vllm/reclaim_probe.py [--n 20] [--lease 60] [--out /work/reclaim-probe]

Two passes, two engines at a time: the candidates in turn on one "warm" pair (one handoff
first, so the NIXL handshake is done), then a stale-descriptor check; then each "cold"
candidate on a fresh pair whose consumer has never talked to the producer. About 7 minutes
on the 2-core machine (each start about 25 s, the "none" and any failing round about 60 s).

Standalone: stdlib only (the router's own NixlConnector is imported, when importable, only
to check that the bodies below are the router's). Every process it starts runs in its own
session and is ended by its own process group on every exit path.

Lease: vLLM 0.32 reads it from ``kv_connector_extra_config.kv_lease_duration`` (default
30 s); ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT`` no longer exists there. Both are set.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import http.client as httpclient
import json
import os
import random
import re
import signal
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from ports import http  # e2e/vllm/ports.py, beside this script (stdlib only)
from probe_engine import ProbeEngine

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
MODEL = "tiny"
START_S = 400.0
REQ_S = 120.0
PROMPT_TOKENS = 440  # + 1 generated token <= max-model-len 512; 4 blocks of 128 on CPU
NUM_BLOCKS = 400  # --num-gpu-blocks-override: 20 orphans x 4 blocks = 20% of the pool
SAMPLE_S = 0.5


# --------------------------------------------------------------------------- bodies


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """narwhal/core/connector.py NixlConnector.prefill_body, copied."""
    dropped = ("stream_options", "min_tokens", "n", "best_of", "max_completion_tokens")
    out = {k: v for k, v in body.items() if k not in dropped}
    out["max_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = {"do_remote_decode": True}
    return out


def decode_body(body: dict[str, Any], descriptor: dict[str, Any]) -> dict[str, Any]:
    """narwhal/core/connector.py NixlConnector.decode_body, copied (descriptor untouched)."""
    out = {
        k: v for k, v in body.items() if k not in ("kv_transfer_params", "prompt_logprobs", "echo")
    }
    out["stream"] = True
    out["kv_transfer_params"] = descriptor
    return out


def check_bodies_match_router() -> str:
    try:
        sys.path.insert(0, str(ROOT))
        from narwhal.core.connector import NixlConnector
    except Exception as exc:  # the vLLM venv has no msgspec: fine, the copy stands
        return f"router connector not importable ({type(exc).__name__}); using the copy"
    sample = {"model": MODEL, "prompt": [5, 6], "max_tokens": 9, "temperature": 0, "n": 1}
    assert NixlConnector().prefill_body(sample) == prefill_body(sample), "prefill body drifted"
    return "prefill body checked against narwhal.core.connector.NixlConnector"


# --------------------------------------------------------------------------- processes


class Engine(ProbeEngine):
    def __init__(self, name: str, role: str, vllm_dir: Path, logs: Path, lease: int) -> None:
        kvt = {
            "kv_connector": "NixlConnector",
            "kv_role": role,
            "kv_buffer_device": "cpu",
            "kv_connector_extra_config": {"kv_lease_duration": lease},
        }
        extra = ["--kv-transfer-config", json.dumps(kvt)]  # replaces serve_nixl.sh's
        extra += ["--num-gpu-blocks-override", str(NUM_BLOCKS)]
        env = {"VLLM_NIXL_ABORT_REQUEST_TIMEOUT": str(lease)}  # read by older vLLMs only
        super().__init__(name, role, vllm_dir, logs, extra, env)

    def metrics(self) -> dict[str, float]:
        status, body = http("GET", self.url + "/metrics", timeout=10)
        out: dict[str, float] = {}
        if status != 200:
            return out
        for line in body.decode(errors="replace").splitlines():
            if line.startswith("vllm:"):
                key, _, val = line.rpartition(" ")
                with contextlib.suppress(ValueError):
                    out[key] = float(val)
        return out


def stream_close_after_headers(url: str, body: Any, timeout: float = REQ_S) -> tuple[int, bytes]:
    """POST, read the status line and headers, then close without reading the body."""
    host, port = url.split("//", 1)[1].split("/", 1)[0].split(":")
    conn = httpclient.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        return resp.status, b""
    finally:
        conn.close()


def pick(metrics: dict[str, float], name: str, **labels: str) -> float:
    total = 0.0
    for key, val in metrics.items():
        base = key.split("{", 1)[0]
        if base != name:
            continue
        if all(f'{k}="{v}"' in key for k, v in labels.items()):
            total += val
    return total


# --------------------------------------------------------------------------- sampling


class Sampler(threading.Thread):
    def __init__(self, producer: Engine, consumer: Engine) -> None:
        super().__init__(daemon=True)
        self.p, self.c = producer, consumer
        self.t0 = time.monotonic()
        self.samples: list[
            tuple[float, float, float, float, float]
        ] = []  # t, usage, run, wait, c_usage
        self.stop_event = threading.Event()
        self.lock = threading.Lock()

    def run(self) -> None:
        while not self.stop_event.is_set():
            t = time.monotonic() - self.t0
            try:
                pm = self.p.metrics()
                cm = self.c.metrics()
                row = (
                    t,
                    pick(pm, "vllm:kv_cache_usage_perc"),
                    pick(pm, "vllm:num_requests_running"),
                    pick(pm, "vllm:num_requests_waiting"),
                    pick(cm, "vllm:kv_cache_usage_perc"),
                )
                with self.lock:
                    self.samples.append(row)
            except OSError:
                pass
            self.stop_event.wait(max(0.0, SAMPLE_S - (time.monotonic() - self.t0 - t)))

    def now(self) -> float:
        return time.monotonic() - self.t0

    def latest(self) -> tuple[float, float, float, float, float] | None:
        with self.lock:
            return self.samples[-1] if self.samples else None

    def between(self, a: float, b: float) -> list[tuple[float, float, float, float, float]]:
        with self.lock:
            return [s for s in self.samples if a <= s[0] <= b]


# --------------------------------------------------------------------------- candidates

NO_SUCH_MODEL = "narwhal-reclaim-no-such-model"


def reclaim_body(kind: str, prompt: list[int], desc: dict[str, Any]) -> dict[str, Any]:
    base = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    if kind in ("a", "d"):  # the router's decode leg, one token
        return decode_body(base, desc)
    if kind in ("b", "bn"):  # rejected by _check_model (404) before admission
        return {
            "model": NO_SUCH_MODEL,
            "prompt": "x",
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": desc,
        }
    if kind == "b2":  # rejected by the renderer (400, max_tokens > max_model_len) before admission
        return {
            "model": MODEL,
            "prompt": "x",
            "max_tokens": 100000,
            "stream": False,
            "kv_transfer_params": desc,
        }
    if kind == "c":  # admitted decode with a one-token prompt (the descriptor's first token)
        return {
            "model": MODEL,
            "prompt": prompt[:1],
            "max_tokens": 1,
            "temperature": 0,
            "stream": False,
            "kv_transfer_params": desc,
        }
    raise ValueError(kind)


CANDIDATES = {
    "none": "no reclaim: wait for the lease",
    "a": "one-token decode, same prompt, router's decode body (stream:true, max_tokens:1),"
    " stream read to the end",
    "b": "rejected before admission: unknown model name (404 from _check_model)",
    "b2": "rejected before admission: max_tokens > max_model_len (400 from the renderer),"
    " prompt 'x'",
    "c": "admitted decode with a one-token prompt (prompt[:1]), max_tokens:1, stream:false",
    "d": "router's decode body (stream:true, max_tokens:1), connection closed right after"
    " the response headers",
    "bn": "b, then a plain one-token request to the consumer every 2 s (at most 15) until"
    " the producer is idle",
}
NUDGE = {"model": MODEL, "prompt": [0], "max_tokens": 1, "temperature": 0, "stream": False}

COUNTERS = [
    ("prompt_tokens", "vllm:prompt_tokens_total", {}),
    ("computed", "vllm:prompt_tokens_by_source_total", {"source": "local_compute"}),
    ("from_kv", "vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"}),
    ("gen_tokens", "vllm:generation_tokens_total", {}),
    ("success", "vllm:request_success_total", {}),
    ("aborted", "vllm:request_success_total", {"finished_reason": "abort"}),
    ("nixl_xfers", "vllm:nixl_xfer_time_seconds_count", {}),
    ("nixl_bytes", "vllm:nixl_bytes_transferred_sum", {}),
    ("nixl_failed_xfer", "vllm:nixl_num_failed_transfers_total", {}),
    ("nixl_failed_notif", "vllm:nixl_num_failed_notifications_total", {}),
    ("kv_expired", "vllm:nixl_num_kv_expired_reqs_total", {}),
    ("notif_after_expiry", "vllm:nixl_num_notifications_after_expiry_total", {}),
]


def counters(m: dict[str, float]) -> dict[str, float]:
    return {short: pick(m, name, **labels) for short, name, labels in COUNTERS}


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {
        k: after.get(k, 0.0) - before.get(k, 0.0)
        for k in after
        if after.get(k, 0.0) != before.get(k, 0.0)
    }


_LOG_NOISE = re.compile(r"^.*?(ERROR|WARNING)\s+\S+\s+\S+\s+\[[^\]]*\]\s*")


def log_findings(text: str) -> tuple[int, int, list[str]]:
    errors = warnings = 0
    msgs: Counter[str] = Counter()
    for line in text.splitlines():
        if " ERROR " in line or "Traceback" in line:
            errors += 1
        elif " WARNING " in line:
            warnings += 1
        else:
            continue
        msg = _LOG_NOISE.sub(r"\1 ", line)
        msg = re.sub(r"cmpl-[\w-]+|[0-9a-f]{8}-[0-9a-f-]{27,}", "<id>", msg)[:150]
        msgs[msg] += 1
    return errors, warnings, [f"{n}x {m}" for m, n in msgs.most_common(4)]


class Probe:
    def __init__(
        self, producer: Engine, consumer: Engine, sampler: Sampler, n: int, lease: int, seed: int
    ):
        self.p, self.c, self.s = producer, consumer, sampler
        self.n, self.lease = n, lease
        self.rng = random.Random(seed)
        self.idle = 0.0
        self.block_share = 1.0 / (NUM_BLOCKS - 1)

    def prompt(self) -> list[int]:
        return [self.rng.randrange(3, 2048) for _ in range(PROMPT_TOKENS)]

    def usage_now(self) -> float:
        return pick(self.p.metrics(), "vllm:kv_cache_usage_perc")

    def wait_idle(self, deadline_t: float) -> float | None:
        """Sampler time when the producer's usage is back at the idle level, or None."""
        while self.s.now() < deadline_t:
            last = self.s.latest()
            if last is not None and last[1] <= self.idle + self.block_share / 2:
                return last[0]
            time.sleep(SAMPLE_S / 2)
        return None

    def prefill(self, prompt: list[int]) -> tuple[int, dict[str, Any] | None, float]:
        body = prefill_body({"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0})
        t = time.monotonic()
        status, raw = http("POST", self.p.url + "/v1/completions", body)
        dt = time.monotonic() - t
        if status != 200:
            return status, None, dt
        parsed = json.loads(raw)
        desc = (parsed.get("choices") or [{}])[0].get("kv_transfer_params") or parsed.get(
            "kv_transfer_params"
        )
        return status, desc, dt

    def send(self, kind: str, prompt: list[int], desc: dict[str, Any]) -> tuple[int, float, str]:
        body = reclaim_body(kind, prompt, desc)
        t = time.monotonic()
        try:
            if kind == "d":
                status, raw = stream_close_after_headers(self.c.url, body)
            else:
                status, raw = http("POST", self.c.url + "/v1/completions", body)
        except OSError as exc:
            return -1, time.monotonic() - t, f"{type(exc).__name__}: {exc}"
        return status, time.monotonic() - t, raw[:160].decode(errors="replace")

    def run_round(self, kind: str, label: str) -> dict[str, Any]:
        print(f"\n=== candidate {label}: {CANDIDATES[kind]}", flush=True)
        # precondition: idle
        if self.wait_idle(self.s.now() + self.lease + 30) is None:
            print("  producer never returned to idle before the round", flush=True)
        time.sleep(1.0)
        before_p, before_c = counters(self.p.metrics()), counters(self.c.metrics())
        off_p, off_c = len(self.p.log_text()), len(self.c.log_text())
        prompts = [self.prompt() for _ in range(self.n)]
        t_start = self.s.now()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(self.prefill, prompts))
        t_prefilled = self.s.now()
        bad = [r[0] for r in results if r[1] is None]
        descs = [(p, r[1]) for p, r in zip(prompts, results, strict=True) if r[1] is not None]
        blocks = [
            len(d["remote_block_ids"][0]) if d.get("remote_block_ids") else 0 for _, d in descs
        ]
        time.sleep(1.5)  # let the sampler see the peak
        peak = max((s[1] for s in self.s.between(t_start, self.s.now())), default=0.0)
        print(
            f"  prefilled {len(descs)}/{self.n} in {t_prefilled - t_start:.1f}s "
            f"(failed statuses {bad}); blocks/request {sorted(set(blocks))}; peak usage {peak:.2%}",
            flush=True,
        )

        lat: list[float] = []
        statuses: Counter[int] = Counter()
        excerpts: list[str] = []
        t_reclaim = None
        if kind != "none":
            t_reclaim = self.s.now()
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                outs = list(pool.map(lambda pd: self.send(kind, pd[0], pd[1]), descs))
            for st, dt, ex in outs:
                lat.append(dt)
                statuses[st] += 1
                if ex and len(excerpts) < 1:
                    excerpts.append(ex)
            print(
                f"  reclaim sent: statuses {dict(statuses)};"
                f" latency median {statistics.median(lat):.2f}s "
                f"max {max(lat):.2f}s; e.g. {excerpts[:1]}",
                flush=True,
            )
        nudges = 0
        if kind == "bn":
            for _ in range(15):
                last = self.s.latest()
                if (
                    last is not None
                    and last[0] > (t_reclaim or 0.0)
                    and last[1] <= self.idle + self.block_share / 2
                ):
                    break
                time.sleep(2.0)
                nudges += 1
                http("POST", self.c.url + "/v1/completions", NUDGE, timeout=30)
            print(f"  nudges sent: {nudges}", flush=True)
        deadline = t_prefilled + self.lease + (10 if kind == "none" else 20)
        t_idle = self.wait_idle(deadline)
        time.sleep(2.0)  # trailing counters
        after_p, after_c = counters(self.p.metrics()), counters(self.c.metrics())
        t_end = self.s.now()
        ref = t_reclaim if t_reclaim is not None else t_prefilled
        res = {
            "kind": label,
            "prefilled": len(descs),
            "prefill_s": t_prefilled - t_start,
            "peak": peak,
            "blocks_per_req": sorted(set(blocks)),
            "statuses": dict(statuses),
            "nudges": nudges,
            "load": os.getloadavg()[0],  # other work on the machine skews every timing
            "lat_median": statistics.median(lat) if lat else None,
            "lat_max": max(lat) if lat else None,
            "excerpt": excerpts[0] if excerpts else "",
            "idle_after_s": None if t_idle is None else t_idle - ref,
            "idle_after_prefill_s": None if t_idle is None else t_idle - t_prefilled,
            "consumer": delta(after_c, before_c),
            "producer": delta(after_p, before_p),
            "log_p": log_findings(self.p.log_text()[off_p:]),
            "log_c": log_findings(self.c.log_text()[off_c:]),
            "timeline": self.timeline(t_start, t_end),
            "t_reclaim_rel": None if t_reclaim is None else t_reclaim - t_start,
            "t_prefilled_rel": t_prefilled - t_start,
            "descs": descs,
        }
        idle = "never" if t_idle is None else f"{res['idle_after_s']:.1f}s"
        print(
            f"  back to idle {idle} after"
            f" {'the reclaim' if t_reclaim is not None else 'the last prefill'};"
            f" consumer {res['consumer']}; producer {res['producer']}",
            flush=True,
        )
        return res

    def timeline(self, a: float, b: float) -> list[tuple[float, float, float, float, float]]:
        """Samples where anything changed (plus the first and last)."""
        rows = self.s.between(a, b)
        out = []
        for i, r in enumerate(rows):
            if i == 0 or i == len(rows) - 1 or r[1:] != rows[i - 1][1:]:
                out.append((r[0] - a, *r[1:]))
        return out

    def stale_test(self, descs: list[tuple[list[int], dict[str, Any]]]) -> dict[str, Any]:
        """vllm#21570: decode with a descriptor whose lease already ran out, vs a fresh one."""
        print("\n=== stale descriptor (lease expired) vs a fresh handoff", flush=True)
        out: dict[str, Any] = {}
        off_p, off_c = len(self.p.log_text()), len(self.c.log_text())
        before_p = counters(self.p.metrics())

        def decode8(
            prompt: list[int], desc: dict[str, Any] | None, salt: str | None = None
        ) -> tuple[int, str]:
            """Eight greedy tokens on the consumer: their ids and logprobs."""
            body: dict[str, Any] = {
                "model": MODEL,
                "prompt": prompt,
                "max_tokens": 8,
                "temperature": 0,
                "stream": False,
                "return_token_ids": True,
                "logprobs": 1,  # the sampled tokens' logprobs: they move when the KV does
            }
            if desc is not None:
                body["kv_transfer_params"] = desc
            if salt is not None:  # a private prefix-cache namespace: computed, never a cache hit
                body["cache_salt"] = salt
            st, raw = http("POST", self.c.url + "/v1/completions", body)
            try:
                choice = json.loads(raw)["choices"][0]
                lps = choice["logprobs"]["token_logprobs"]
                return st, f"{choice['token_ids']} logprobs {[round(x, 4) for x in lps]}"
            except (ValueError, KeyError, IndexError, TypeError):
                return st, raw[:160].decode(errors="replace")

        # overwrite every free block on the producer: plain requests, no KV transfer
        churn = NUM_BLOCKS // 4 + 20
        plain = {"model": MODEL, "max_tokens": 1, "temperature": 0, "stream": False}
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            codes = Counter(
                pool.map(
                    lambda _: http(
                        "POST", self.p.url + "/v1/completions", {**plain, "prompt": self.prompt()}
                    )[0],
                    range(churn),
                )
            )
        out["churn"] = (
            f"{churn} plain {PROMPT_TOKENS}-token requests on the producer first: {dict(codes)}"
        )
        prompt, desc = descs[0]
        salt = f"ref-{time.monotonic_ns()}"
        out["stale_ref"] = decode8(prompt, None, salt)  # the right answer, computed locally
        out["stale"] = decode8(prompt, desc)  # reads the expired descriptor's blocks
        out["stale_then_plain"] = decode8(prompt, None)  # same prompt again, unsalted
        fresh = self.prompt()
        out["fresh_ref"] = decode8(fresh, None, salt)
        st, fdesc, _ = self.prefill(fresh)
        out["fresh"] = decode8(fresh, fdesc) if fdesc else (st, "prefill failed")
        time.sleep(2.0)
        out["producer"] = delta(counters(self.p.metrics()), before_p)
        out["log_p"] = log_findings(self.p.log_text()[off_p:])
        out["log_c"] = log_findings(self.c.log_text()[off_c:])
        print(f"  {json.dumps({k: v for k, v in out.items()}, default=str)}", flush=True)
        return out


# --------------------------------------------------------------------------- report


def fmt_s(x: float | None) -> str:
    return "—" if x is None else f"{x:.1f}"


def report(
    results: list[dict[str, Any]], stale: dict[str, Any] | None, meta: dict[str, Any]
) -> str:
    lines = ["# NixlConnector reclaim probe", ""]
    for k, v in meta.items():
        lines.append(f"- {k}: {v}")
    lines += ["", "## Candidates", ""]
    for k, v in CANDIDATES.items():
        lines.append(f"- **{k}**: {v}")
    lines += [
        "",
        "| cand | peak KV | reclaim HTTP | latency med / max s |"
        " idle after reclaim (or last prefill) s | load 1m |"
        " consumer compute (Δ counters) | producer Δ | errors/warnings P | errors/warnings C |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lat = "—" if r["lat_median"] is None else f"{r['lat_median']:.2f} / {r['lat_max']:.2f}"
        cons = ", ".join(f"{k}={v:g}" for k, v in r["consumer"].items()) or "none"
        prod = (
            ", ".join(
                f"{k}={v:g}"
                for k, v in r["producer"].items()
                if k != "prompt_tokens" and k != "computed" and k != "gen_tokens" and k != "success"
            )
            or "—"
        )
        idle = fmt_s(r["idle_after_s"]) if r["idle_after_s"] is not None else "not idle"
        sts = str(r["statuses"] or "—") + (f" + {r['nudges']} nudges" if r.get("nudges") else "")
        lines.append(
            f"| {r['kind']} | {r['peak']:.1%} | {sts} | {lat} | {idle} | {r['load']:.1f} |"
            f" {cons} | {prod} |"
            f" {r['log_p'][0]}/{r['log_p'][1]} | {r['log_c'][0]}/{r['log_c'][1]} |"
        )
    lines += ["", "## Log findings (new lines during each round)", ""]
    for r in results:
        for side in ("log_p", "log_c"):
            for m in r[side][2]:
                lines.append(f"- {r['kind']} {side[-1].upper()}: `{m}`")
        if r["excerpt"]:
            lines.append(f"- {r['kind']} reclaim response excerpt: `{r['excerpt'][:160]}`")
    lines += [
        "",
        "## Producer KV usage timelines (t s from the first prefill → usage %, running, waiting;"
        " consumer usage %)",
        "",
    ]
    for r in results:
        marks = f"prefill done at {r['t_prefilled_rel']:.1f}s"
        if r["t_reclaim_rel"] is not None:
            marks += f", reclaim sent at {r['t_reclaim_rel']:.1f}s"
        pts = " ".join(
            f"{t:.1f}→{u:.1%}({int(run)}/{int(wait)};C{cu:.1%})"
            for t, u, run, wait, cu in r["timeline"]
        )
        lines += [f"- **{r['kind']}** ({marks}): {pts}", ""]
    if stale:
        lines += ["## Stale descriptor (vllm#21570)", ""]
        lines.append(f"- {stale['churn']}")
        for k in ("stale_ref", "stale", "stale_then_plain", "fresh_ref", "fresh"):
            lines.append(f"- {k}: HTTP {stale[k][0]} token_ids {stale[k][1]}")
        lines.append(
            "- reading: a difference from stale_ref means the consumer decoded from blocks the"
            " producer had reused (HTTP 200, no consumer error). No difference proves nothing with"
            " the dummy weights: every logprob is -ln(2048) = -7.6246, the logits are flat, the"
            " output does not depend on the KV. The producer's ERROR line and its"
            " notif_after_expiry counter are the only signs of the stale read."
        )
        lines.append(f"- producer Δ: {stale['producer']}")
        for side in ("log_p", "log_c"):
            for m in stale[side][2]:
                lines.append(f"- {side[-1].upper()}: `{m}`")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def start_pair(
    tag: str, vllm_dir: Path, logs: Path, lease: int, started: list[Engine]
) -> tuple[Engine, Engine]:
    """Both engines up; on a port clash both again on fresh ports (twice at most)."""
    for attempt in (1, 2):
        producer = Engine(f"producer-{tag}-{attempt}", "kv_producer", vllm_dir, logs, lease)
        consumer = Engine(f"consumer-{tag}-{attempt}", "kv_consumer", vllm_dir, logs, lease)
        for e in (producer, consumer):
            e.start()
            started.append(e)
        assert producer.proc is not None
        assert consumer.proc is not None
        print(
            f"\nstarting producer {producer.url} (pid {producer.proc.pid})"
            f" and consumer {consumer.url} "
            f"(pid {consumer.proc.pid}); logs in {logs}",
            flush=True,
        )
        deadline = time.monotonic() + START_S
        errs = [producer.wait_ready(deadline), consumer.wait_ready(deadline)]
        if not any(errs):
            return producer, consumer
        for e in (producer, consumer):
            e.stop()
            started.remove(e)
        if attempt == 2 or "clash" not in errs:
            raise RuntimeError(f"engines failed: {errs}")
    raise AssertionError("unreachable")


def stop_pair(pair: tuple[Engine, Engine], sampler: Sampler | None, started: list[Engine]) -> None:
    if sampler is not None:
        sampler.stop_event.set()
        sampler.join(timeout=5)
    for e in reversed(pair):
        e.stop()
        with contextlib.suppress(ValueError):
            started.remove(e)


def session(
    tag: str,
    kinds: list[str],
    warm: bool,
    args: argparse.Namespace,
    logs: Path,
    started: list[Engine],
    meta: dict[str, Any],
    results: list[dict[str, Any]],
) -> dict[str, Any] | None:
    """One producer/consumer pair: optional warm-up handoff, the candidates, the stale test."""
    t0 = time.monotonic()
    pair = start_pair(tag, Path(args.vllm_dir), logs, args.lease, started)
    producer, consumer = pair
    sampler = None
    stale = None
    try:
        meta[f"{tag}: engines ready"] = f"{time.monotonic() - t0:.1f}s"
        for e in pair:  # the metric names this vLLM exposes, for reference
            (logs / f"{e.name}.metrics.txt").write_bytes(
                http("GET", e.url + "/metrics", timeout=30)[1]
            )
        sampler = Sampler(producer, consumer)
        sampler.start()
        probe = Probe(producer, consumer, sampler, args.n, args.lease, args.seed + len(results))
        if warm:  # one full handoff, so the NIXL handshake is not charged to the first candidate
            t = time.monotonic()
            prompt = probe.prompt()
            st, desc, _ = probe.prefill(prompt)
            wst = probe.send("a", prompt, desc)[0] if desc else st
            meta[f"{tag}: warm-up handoff"] = f"HTTP {wst} in {time.monotonic() - t:.1f}s"
        else:
            meta[f"{tag}: warm-up handoff"] = (
                "none: the candidate's consumer has no NIXL handshake yet"
            )
        time.sleep(3.0)
        probe.idle = probe.usage_now()
        meta[f"{tag}: idle producer usage"] = f"{probe.idle:.2%}"
        for kind in kinds:
            label = kind if warm else f"{kind} (cold)"
            try:
                results.append(probe.run_round(kind, label))
            except Exception as exc:  # record it and go on with the next candidate
                print(f"  round {label} failed: {type(exc).__name__}: {exc}", flush=True)
                meta[f"round {label} failed"] = f"{type(exc).__name__}: {exc}"
        none = next((r for r in results if r["kind"] == "none" and r["descs"]), None)
        if warm and none is not None:
            stale = probe.stale_test(none["descs"])
    finally:
        stop_pair(pair, sampler, started)
    return stale


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--lease", type=int, default=60)
    ap.add_argument(
        "--candidates",
        default="none,a,b,b2,c,d",
        help="run on one warm pair (after a warm-up handoff), in this order",
    )
    ap.add_argument(
        "--cold-candidates",
        default="a,b,bn,c,d",
        help="each on a fresh pair with no handoff before it ('' to skip)",
    )
    ap.add_argument(
        "--vllm-dir",
        default=os.environ.get("NARWHAL_VLLM_DIR") or str(Path.home() / ".cache/narwhal-vllm"),
    )
    ap.add_argument("--out", default="/work/reclaim-probe")
    ap.add_argument("--results", default="results.md", help="file name under --out")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    out = Path(args.out)
    logs = out / f"logs-{time.strftime('%Y%m%d-%H%M%S')}"
    logs.mkdir(parents=True, exist_ok=True)
    if not (Path(args.vllm_dir) / "venv").exists():
        print(f"no vLLM environment in {args.vllm_dir}", file=sys.stderr)
        return 2
    warm_kinds = [k for k in args.candidates.split(",") if k]
    cold_kinds = [k for k in args.cold_candidates.split(",") if k]
    for k in warm_kinds + cold_kinds:
        if k not in CANDIDATES:
            print(f"unknown candidate {k}", file=sys.stderr)
            return 2
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, _interrupt)
    t_script = time.monotonic()
    started: list[Engine] = []
    results: list[dict[str, Any]] = []
    stale = None
    meta: dict[str, Any] = {
        "bodies": check_bodies_match_router(),
        "N": args.n,
        "lease_s": args.lease,
        "prompt_tokens": PROMPT_TOKENS,
        "num_blocks": NUM_BLOCKS,
        "logs": str(logs),
    }
    rc = 0
    try:
        if warm_kinds:
            stale = session("warm", warm_kinds, True, args, logs, started, meta, results)
        for kind in cold_kinds:
            session(f"cold-{kind}", [kind], False, args, logs, started, meta, results)
    except KeyboardInterrupt as exc:
        print(f"interrupted: {exc}", file=sys.stderr)
        rc = 130
    except RuntimeError as exc:
        print(str(exc), file=sys.stderr)
        rc = 1
    finally:
        for e in reversed(started):
            e.stop()
        meta["script_s"] = round(time.monotonic() - t_script, 1)
        if results:
            text = report(results, stale, meta)
            (out / args.results).write_text(text)
            print("\n" + text)
            print(f"written to {out / args.results}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
