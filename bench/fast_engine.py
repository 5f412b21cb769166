"""A fast fake vLLM engine for the peer benchmarks (``bench/peers.py``) only.

BENCH-ONLY. narwhal/ must never import this module; it runs from the benchmark venv
(aiohttp + uvloop, standard library otherwise; no narwhal, no msgspec needed). It answers
with the bytes ``narwhal fake-engine`` (``narwhal/fake_engine/``) sends on the paths a PD
router uses, so ``narwhal serve`` and vllm-router (``--vllm-pd-disaggregation``) route
through it unchanged, in about 0.1 ms a request over a keep-alive connection where the
trio engine takes 0.3 ms (prefill) to 2 ms (a 64-token stream): the responses are
assembled from bytes precomputed per token count, and with ``--itl-s 0`` a whole decode
stream goes out in one write.

    python bench/fast_engine.py --port 0 --role prefill|decode|both [--itl-s S]
        [--max-model-len N] [--kv-lease-s S] [--engine-id NAME] [--model NAME]
        [--host 127.0.0.1] [--kv-port N] [...ignored fake-engine options]

At start it prints ``fake-engine <engine id> (<role>) on http://HOST:PORT, kv side channel
:PORT`` on stdout, the line ``narwhal fake-engine`` prints (``Proc.wait_for_url``).

Served (as the fake engine serves them):
* ``POST /v1/completions``, ``/v1/chat/completions``: a one-token non-streamed prefill
  (``kv_transfer_params: {"do_remote_decode": true}``) answers with a vLLM 0.32
  NixlConnector descriptor (remote_engine_id, remote_block_ids, remote_request_id,
  remote_host/port, ...); a decode leg carrying ``do_remote_prefill`` is answered at once,
  nothing is pulled (a descriptor without remote_host/remote_port fails as vLLM's failed
  load does); streams are SSE chunks, one token each, with chat's role chunk first, the
  ``stream_options.include_usage`` usage chunk and ``data: [DONE]``; ``max_tokens``
  (chat: ``max_completion_tokens`` first) tokens, 16 by default, a fixed ``--itl-s``
  between tokens; non-streamed answers whole. The model, max_tokens and context checks
  answer vLLM's errors (a reclaim leg's unknown model is a 404, as the router expects).
* ``GET /health``, ``/version``, ``/v1/models`` (with max_model_len), ``/metrics`` (the
  fake engine's series: running requests and token counters are true counts, the rest 0),
  ``POST /tokenize``, ``/detokenize``; ``GET /fake/stats`` with a few counters (prefill,
  decode_remote, prompt_tokens, generation_tokens).

Not modelled (use ``narwhal fake-engine`` for them): faults, the cost model, KV leases
and pulls (``--kv-lease-s`` is accepted and ignored), logprobs, echo, stop strings, tools,
``n`` > 1, ``--chunk-tokens`` (a request that asks for them gets the plain answer). The
KV side-channel port is a listener that closes every connection. Generated text is one
fixed word sequence (the fake's vocabulary in the order of its generator from a fixed
state), not a function of the prompt.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import re
import secrets
import signal
import sys
import time
import uuid
import zlib
from typing import Any

from aiohttp import web

VERSION = "0.32.0"
SYSTEM_FINGERPRINT = "vllm-0.32.0-fake0000"
DEFAULT_MAX_TOKENS = 16
BLOCK_TOKENS = 16
VOCAB = (
    " the", " quick", " brown", " fox", " jumps", " over", " lazy", " dog", "ward", "zip",
    " parameters", " once", " upon", " a", " time", " in", " river", " stone", " light",
    " and", " of", " to", " narwhal", " sea", " ice", " tusk", " deep", " cold", " blue",
    " swims", " north", " far",
)  # fmt: skip
GENERATED_ID = 100
CACHE_LIMIT = 4096  # distinct (kind, token count) templates kept


def _dumps(value: object) -> bytes:
    """Compact JSON, as msgspec writes it."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def _words(count: int) -> list[int]:
    """The fixed script: the fake's generator (glibc rand) from state 1, as VOCAB indices."""
    x, out = 1, []
    for _ in range(count):  # bounded by count
        x = (x * 1103515245 + 12345) & 0x7FFFFFFF
        out.append((x >> 8) % len(VOCAB))
    return out


_VOCAB_JSON = tuple(_dumps(w) for w in VOCAB)
_SAFE_ID = re.compile(r"[A-Za-z0-9._:\-]*\Z").match
_SSE = b"text/event-stream; charset=utf-8"
_JSON = {"Content-Type": "application/json"}
_SSE_HEADERS = {"Content-Type": _SSE.decode()}
_NOT_FOUND = b'{"detail":"Not Found"}'
_DONE = b"data: [DONE]\n\n"

# a chunk's bytes after the response's common head (id, object, created, model)
_CHAT_ROLE = (
    b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
    b'"finish_reason":null}],"prompt_token_ids":null,"prompt_text":null}'
)
_CHAT_TAIL = b',"logprobs":null,"finish_reason":null,"token_ids":null}]}'
_CHAT_LAST = b',"logprobs":null,"finish_reason":"length","stop_reason":null,"token_ids":null}]}'
_CMPL_TAIL = (
    b',"logprobs":null,"finish_reason":null,"stop_reason":null,'
    b'"prompt_token_ids":null,"token_ids":null}]}'
)
_CMPL_LAST = (
    b',"logprobs":null,"finish_reason":"length","stop_reason":null,'
    b'"prompt_token_ids":null,"token_ids":null}]}'
)


def _error(message: str, kind: str, code: int, param: str | None = None) -> bytes:
    return _dumps({"error": {"message": message, "type": kind, "param": param, "code": code}})


def _stream_error() -> bytes:
    """vLLM's in-stream error for a failed KV load (json.dumps spacing, as vLLM writes it)."""
    return (
        b'data: {"error": {"message": "Internal server error", "type": "InternalServerError", '
        b'"param": null, "code": 500}}\n\ndata: [DONE]\n\n'
    )


class Templates:
    """Per (chat, token count): the stream's chunk remainders and the joined SSE body."""

    def __init__(self) -> None:
        self.script = _words(0)
        self.frames: dict[tuple[bool, int], list[bytes]] = {}
        self.joined: dict[tuple[bool, int, bool], list[bytes]] = {}
        self.texts: dict[int, bytes] = {}

    def _ids(self, count: int) -> list[int]:
        if len(self.script) < count:
            self.script = _words(max(count, 2 * len(self.script)))
        return self.script[:count]

    def frames_of(self, chat: bool, count: int) -> list[bytes]:
        """Each chunk's bytes after the common head: chat's role chunk, then one per token."""
        key = (chat, count)
        found = self.frames.get(key)
        if found is not None:
            return found
        out = [_CHAT_ROLE] if chat else []
        ids = self._ids(count)
        for n, i in enumerate(ids):
            last = n == count - 1
            text = _VOCAB_JSON[i]
            if chat:
                body = b'"choices":[{"index":0,"delta":{"content":' + text + b"}"
                out.append(body + (_CHAT_LAST if last else _CHAT_TAIL))
            else:
                body = b'"choices":[{"index":0,"text":' + text
                out.append(body + (_CMPL_LAST if last else _CMPL_TAIL))
        if len(self.frames) < CACHE_LIMIT:
            self.frames[key] = out
        return out

    def joined_of(self, chat: bool, count: int, usage: bool) -> list[bytes]:
        """The whole stream as pieces to join with the common head: ``head.join(pieces)``
        is every chunk and, with ``usage``, the head of the usage chunk at the end (its
        counts go after it)."""
        key = (chat, count, usage)
        found = self.joined.get(key)
        if found is not None:
            return found
        frames = self.frames_of(chat, count)
        pieces = [b"data: "]
        for n, frame in enumerate(frames):
            end = n == len(frames) - 1
            pieces.append(frame + (b"\n\ndata: " if usage or not end else b"\n\n" + _DONE))
        if usage:
            pieces.append(b"")
        if len(self.joined) < CACHE_LIMIT:
            self.joined[key] = pieces
        return pieces

    def text_of(self, count: int) -> bytes:
        """The generated text of ``count`` tokens, as a JSON string."""
        found = self.texts.get(count)
        if found is None:
            found = _dumps("".join(VOCAB[i] for i in self._ids(count)))
            if len(self.texts) < CACHE_LIMIT:
                self.texts[count] = found
        return found


def _prompt_tokens(body: dict[str, Any], chat: bool) -> int:
    """The fake engine's count: whitespace words; chat adds 4 per message. A copy of
    ``narwhal.fake_engine.generation.prompt_of``'s rule: this engine runs in the peers' venv,
    without narwhal, so it shares no code with the router it measures."""
    if chat:
        words, extra = [], 0
        for message in body.get("messages") or []:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):
                content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
            words.append(str(content or ""))
            extra += 4
        return len("\n".join(words).split()) + extra
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        if all(isinstance(p, int) for p in prompt):
            return len(prompt)
        prompt = " ".join(map(str, prompt))
    return max(1, len(str(prompt).split()))


def _prompt_text(body: dict[str, Any], chat: bool) -> str:
    if chat:
        texts = []
        for message in body.get("messages") or []:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):
                content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
            texts.append(str(content or ""))
        return "\n".join(texts)
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        prompt = " ".join(map(str, prompt))
    return str(prompt)


class FastEngine:
    def __init__(self, args: argparse.Namespace) -> None:
        self.model = args.model
        self.model_json = _dumps(args.model)
        self.role = args.role
        self.engine_id = args.engine_id or str(uuid.uuid4())
        self.engine_id_json = _dumps(self.engine_id)
        self.host = args.host
        self.itl_s = max(0.0, args.itl_s)
        self.max_model_len = args.max_model_len
        self.kv_port = 0
        self.start_time = time.time()
        self.t = Templates()
        self.blocks = itertools.count()
        self.running = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.decode_remote = 0  # decode legs that carried a descriptor (nothing pulled)
        self.prefills = 0  # descriptors handed out
        self.routes = {
            ("POST", "/v1/completions"): self.completions,
            ("POST", "/v1/chat/completions"): self.chat,
            ("GET", "/health"): self.health,
            ("GET", "/version"): self.version,
            ("GET", "/v1/models"): self.models,
            ("GET", "/metrics"): self.metrics,
            ("POST", "/tokenize"): self.tokenize,
            ("POST", "/detokenize"): self.detokenize,
            ("GET", "/fake/stats"): self.stats,
        }

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        route = self.routes.get((request.method, request.path))
        if route is None:
            return web.Response(status=404, body=_NOT_FOUND, headers=_JSON)
        return await route(request)

    # ---- side paths ------------------------------------------------------------------------

    async def health(self, request: web.BaseRequest) -> web.StreamResponse:
        return web.Response(status=200, headers=_JSON)

    async def version(self, request: web.BaseRequest) -> web.StreamResponse:
        return web.Response(body=_dumps({"version": VERSION}), headers=_JSON)

    async def models(self, request: web.BaseRequest) -> web.StreamResponse:
        card = {
            "id": self.model,
            "object": "model",
            "created": int(self.start_time),
            "owned_by": "vllm",
            "root": self.model,
            "parent": None,
            "max_model_len": self.max_model_len,
        }
        return web.Response(body=_dumps({"object": "list", "data": [card]}), headers=_JSON)

    async def metrics(self, request: web.BaseRequest) -> web.StreamResponse:
        label = f'{{model_name="{self.model}"}}'
        lines = [
            "# HELP process_start_time_seconds Start time of the process since unix epoch.",
            "# TYPE process_start_time_seconds gauge",
            f"process_start_time_seconds {self.start_time:.3f}",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{label} {self.running}",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{label} 0",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{label} {0.0:.6f}",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{label} {self.prompt_tokens}",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{label} {self.generation_tokens}",
            "# TYPE vllm:prefix_cache_queries_total counter",
            f"vllm:prefix_cache_queries_total{label} 0",
            "# TYPE vllm:prefix_cache_hits_total counter",
            f"vllm:prefix_cache_hits_total{label} 0",
            "# TYPE vllm:nixl_xfer_time_seconds histogram",
            f"vllm:nixl_xfer_time_seconds_count{label} 0",
            "# TYPE vllm:nixl_bytes_transferred histogram",
            f"vllm:nixl_bytes_transferred_sum{label} 0",
            f"vllm:nixl_bytes_transferred_count{label} 0",
            "# TYPE vllm:nixl_num_failed_transfers counter",
            f"vllm:nixl_num_failed_transfers_total{label} 0",
        ]
        body = ("\n".join(lines) + "\n").encode()
        headers = {"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
        return web.Response(body=body, headers=headers)

    async def stats(self, request: web.BaseRequest) -> web.StreamResponse:
        """A few of the fake engine's ``/fake/stats`` counters (what this engine counts)."""
        counters = {
            "prefill": self.prefills,
            "decode_remote": self.decode_remote,
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
        }
        stats = {"engine_id": self.engine_id, "role": self.role, "counters": counters}
        return self._json(200, _dumps({**stats, "running": self.running, "waiting": 0}))

    async def _object_body(self, request: web.BaseRequest) -> dict[str, Any] | web.Response:
        """The request's JSON object, or the 400 the fake engine answers without one."""
        try:
            body = json.loads(await request.read())
        except (ValueError, RecursionError):  # nested past the decoder: not JSON to it
            return self._json(400, _error("Invalid JSON body", "Bad Request", 400))
        if not isinstance(body, dict):
            return self._json(400, _error("Body must be an object", "Bad Request", 400))
        return body

    async def _side_body(self, request: web.BaseRequest) -> dict[str, Any] | web.Response:
        body = await self._object_body(request)
        if isinstance(body, web.Response):
            return body
        model = body.get("model")
        if model is not None and model != self.model:
            msg = f"The model `{model}` does not exist. Valid aliases: {self.model}."
            return self._json(404, _error(msg, "NotFoundError", 404, "model"))
        return body

    async def tokenize(self, request: web.BaseRequest) -> web.StreamResponse:
        body = await self._side_body(request)
        if isinstance(body, web.Response):
            return body
        chat = "messages" in body
        words = _prompt_text(body, chat).split()
        count = _prompt_tokens(body, chat)
        tokens = [zlib.crc32(w.encode()) % 32000 for w in words][:count]
        tokens += [1] * (count - len(tokens))
        strs = (words + [""] * count)[:count] if body.get("return_token_strs") is True else None
        reply = {
            "count": count,
            "max_model_len": self.max_model_len,
            "tokens": tokens,
            "token_strs": strs,
        }
        return self._json(200, _dumps(reply))

    async def detokenize(self, request: web.BaseRequest) -> web.StreamResponse:
        body = await self._side_body(request)
        if isinstance(body, web.Response):
            return body
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
            msg = "1 validation error:\n  body.tokens: Input should be a list of integers >= 0"
            return self._json(400, _error(msg, "Bad Request", 400, "body.tokens"))
        text = "".join(VOCAB[t % len(VOCAB)] for t in tokens)
        return self._json(200, _dumps({"prompt": text}))

    @staticmethod
    def _json(status: int, body: bytes) -> web.Response:
        return web.Response(status=status, body=body, headers=_JSON)

    # ---- completions -----------------------------------------------------------------------

    async def completions(self, request: web.BaseRequest) -> web.StreamResponse:
        return await self._completion(request, False)

    async def chat(self, request: web.BaseRequest) -> web.StreamResponse:
        return await self._completion(request, True)

    def _validate(
        self, body: dict[str, Any], chat: bool, prompt_tokens: int
    ) -> web.Response | None:
        """vLLM's checks, as the fake engine makes them."""
        model = body.get("model")
        if model != self.model:
            msg = f"The model `{model}` does not exist. Valid aliases: {self.model}."
            return self._json(404, _error(msg, "NotFoundError", 404, "model"))
        max_tokens = body.get("max_completion_tokens" if chat else "max_tokens")
        if max_tokens is None and chat:
            max_tokens = body.get("max_tokens")
        if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
            msg = f"1 validation error:\n  body.max_tokens: invalid value {max_tokens!r}"
            return self._json(400, _error(msg, "Bad Request", 400, "body.max_tokens"))
        limit = self.max_model_len
        if isinstance(max_tokens, int) and max_tokens > limit:
            msg = (
                f"max_tokens={max_tokens} cannot be greater than max_model_len={limit}. "
                f"Please request fewer output tokens. (parameter=max_tokens, value={max_tokens})"
            )
            return self._json(400, _error(msg, "BadRequestError", 400, "max_tokens"))
        if prompt_tokens > limit:
            over = limit + 1
            msg = (
                f"This model's maximum context length is {limit} tokens. However, your prompt "
                f"contains at least {over} input tokens, which exceeds this limit even without "
                f"any output tokens. Please reduce the length of the input prompt. "
                f"(parameter=input_tokens, value={over})"
            )
            return self._json(400, _error(msg, "BadRequestError", 400))
        if prompt_tokens + (max_tokens or 1) > limit:
            msg = (
                f"This model's maximum context length is {limit} tokens. However, your request "
                f"has {prompt_tokens} input tokens. Please reduce the length of the input."
            )
            return self._json(400, _error(msg, "BadRequestError", 400, "prompt"))
        kv = body.get("kv_transfer_params")
        if kv is not None and not isinstance(kv, dict):
            msg = (
                "1 validation error:\n  body.kv_transfer_params: Input should be a valid dictionary"
            )
            return self._json(400, _error(msg, "Bad Request", 400, "body.kv_transfer_params"))
        return None

    async def _completion(self, request: web.BaseRequest, chat: bool) -> web.StreamResponse:
        body = await self._object_body(request)
        if isinstance(body, web.Response):
            return body
        prompt_tokens = _prompt_tokens(body, chat)
        problem = self._validate(body, chat, prompt_tokens)
        if problem is not None:
            return problem
        # the answer's count, as the fake engine's ``asks.ask_of`` reads it
        limit = body.get("max_completion_tokens") if chat else None
        count = limit or body.get("max_tokens") or DEFAULT_MAX_TOKENS
        if type(count) is not int or prompt_tokens + count >= self.max_model_len:
            count = DEFAULT_MAX_TOKENS
        kv = body.get("kv_transfer_params")
        if not isinstance(kv, dict):
            kv = {}
        stream = body.get("stream") is True
        prefill = kv.get("do_remote_decode") is True
        remote = kv.get("do_remote_prefill") is True
        backend_id = request.headers.get("x-request-id", "") or secrets.token_hex(8)
        resp_id = ("chatcmpl-" if chat else "cmpl-") + backend_id
        id_json = resp_id.encode() if _SAFE_ID(resp_id) else _dumps(resp_id)[1:-1]
        if chat:
            obj = b"chat.completion.chunk" if stream else b"chat.completion"
        else:
            obj = b"text_completion"
        created = b"%d" % int(time.time())
        head = (
            b'{"id":"' + id_json + b'","object":"' + obj + b'","created":' + created
            + b',"model":' + self.model_json + b","
        )  # fmt: skip
        self.running += 1
        try:
            if remote and self.role != "prefill":
                if (
                    not isinstance(kv.get("remote_host"), str)
                    or type(kv.get("remote_port")) is not int
                ):
                    return await self._transfer_failed(request, stream)
                self.decode_remote += 1
            self.prompt_tokens += prompt_tokens
            if stream:
                options = body.get("stream_options")
                usage = isinstance(options, dict) and options.get("include_usage") is True
                return await self._stream(request, head, chat, count, prompt_tokens, usage)
            descriptor = b"null"
            if prefill and self.role != "decode":
                descriptor = self._descriptor(resp_id, chat, prompt_tokens)
                self.prefills += 1
            self.generation_tokens += count
            return self._json(200, self._full(head, chat, count, prompt_tokens, descriptor))
        finally:
            self.running -= 1

    def _descriptor(self, resp_id: str, chat: bool, prompt_tokens: int) -> bytes:
        """The descriptor as vLLM 0.32 (and the fake engine) writes it; nothing is held."""
        suffix = secrets.token_hex(4)
        rid = f"{resp_id}-{suffix}" if chat else f"{resp_id}-0-{suffix}"
        count = max(1, -(-prompt_tokens // BLOCK_TOKENS))
        first = next(self.blocks)
        if count > 1:  # one count() step per block, as the fake's store numbers them
            self.blocks = itertools.count(first + count)
        blocks = ",".join(map(str, range(first, first + count))).encode()
        return (
            b'{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[['
            + blocks + b']],"remote_engine_id":' + self.engine_id_json
            + b',"remote_request_id":' + _dumps(rid)
            + b',"remote_host":' + _dumps(self.host)
            + b',"remote_port":%d,"tp_size":1,"dcp_size":1,"pp_size":1,"remote_num_tokens":%d,'
            b'"remote_blocks_expiry_time":null,"transfer_mode":"pull",'
            b'"remote_prefill_cached_tokens":0}' % (self.kv_port, prompt_tokens)
        )  # fmt: skip

    def _full(self, head: bytes, chat: bool, count: int, prompt_tokens: int, kv: bytes) -> bytes:
        """A non-streamed answer, field for field as the fake's ``answers.full``."""
        text = self.t.text_of(count)
        if chat:
            choice = (
                b'{"index":0,"message":{"role":"assistant","content":' + text
                + b',"refusal":null,"annotations":null,"audio":null,"function_call":null,'
                b'"reasoning":null},"logprobs":null,"finish_reason":"length",'
                b'"stop_reason":null,"token_ids":null,"routed_experts":null}'
            )  # fmt: skip
        else:
            choice = (
                b'{"index":0,"text":' + text + b',"logprobs":null,"finish_reason":"length",'
                b'"stop_reason":null,"token_ids":null,"prompt_logprobs":null,'
                b'"prompt_token_ids":null,"routed_experts":null}'
            )
        usage = (
            b'"usage":{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d,'
            b'"prompt_tokens_details":null,"completion_tokens_details":null}'
            % (prompt_tokens, prompt_tokens + count, count)
        )
        extra = (
            b',"prompt_logprobs":null,"prompt_token_ids":null,"prompt_text":null' if chat else b""
        )
        return (
            head + b'"choices":[' + choice + b'],"service_tier":null,"system_fingerprint":"'
            + SYSTEM_FINGERPRINT.encode() + b'",' + usage + extra
            + b',"kv_transfer_params":' + kv + b',"ec_transfer_params":null,"metrics":null}'
        )  # fmt: skip

    @staticmethod
    def _usage_rest(prompt_tokens: int, count: int) -> bytes:
        return (
            b'"choices":[],"usage":{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d},'
            b'"system_fingerprint":"' % (prompt_tokens, prompt_tokens + count, count)
            + SYSTEM_FINGERPRINT.encode() + b'"}\n\n' + _DONE
        )  # fmt: skip

    async def _stream(
        self,
        request: web.BaseRequest,
        head: bytes,
        chat: bool,
        count: int,
        prompt_tokens: int,
        usage: bool,
    ) -> web.StreamResponse:
        tail = self._usage_rest(prompt_tokens, count) if usage else b""
        if self.itl_s <= 0:  # the whole stream in one write, chunked as vLLM's
            data = head.join(self.t.joined_of(chat, count, usage)) + tail
            self.generation_tokens += count
            whole = web.Response(body=data, headers=_SSE_HEADERS)
            whole.enable_chunked_encoding()
            return whole
        response = web.StreamResponse(status=200, headers=_SSE_HEADERS)
        await response.prepare(request)
        frames = self.t.frames_of(chat, count)
        first = 1 if chat else 0  # chat's role chunk goes out with the first token
        opening = frames[: first + 1]
        await response.write(b"".join(b"data: " + head + f + b"\n\n" for f in opening))
        self.generation_tokens += 1
        for frame in frames[first + 1 :]:  # bounded: count tokens
            await asyncio.sleep(self.itl_s)
            await response.write(b"data: " + head + frame + b"\n\n")
            self.generation_tokens += 1
        await response.write(b"data: " + head + tail if usage else _DONE)
        await response.write_eof()
        return response

    async def _transfer_failed(self, request: web.BaseRequest, stream: bool) -> web.StreamResponse:
        """What vLLM answers when a KV load fails."""
        if not stream:
            body = _error("Internal server error", "InternalServerError", 500)
            return self._json(500, body)
        response = web.StreamResponse(status=200, headers=_SSE_HEADERS)
        await response.prepare(request)
        await response.write(_stream_error())
        await response.write_eof()
        return response


class _Refuse(asyncio.Protocol):
    """The KV side channel's port: held so descriptors name a real port; nothing is served."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True, help="port to listen on (0: any)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--role", choices=("prefill", "decode", "both"), default="both")
    parser.add_argument("--model", default="fake-model")
    parser.add_argument("--engine-id", default="")
    parser.add_argument("--kv-port", type=int, default=0)
    parser.add_argument("--itl-s", type=float, default=0.0)
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--kv-lease-s", type=float, default=30.0, help="accepted, ignored")
    # the rest of narwhal fake-engine's options are accepted and ignored
    args, _ignored = parser.parse_known_args(argv)
    return args


async def main(args: argparse.Namespace) -> None:
    engine = FastEngine(args)
    loop = asyncio.get_running_loop()
    kv_server = await loop.create_server(_Refuse, args.host, args.kv_port)
    engine.kv_port = kv_server.sockets[0].getsockname()[1]
    server = web.Server(engine.handle, access_log=None)
    runner = web.ServerRunner(server, handle_signals=False, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port, backlog=4096)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    url = f"http://{args.host}:{port}"
    print(
        f"fake-engine {engine.engine_id} ({args.role}) on {url}, kv side channel :{engine.kv_port}",
        flush=True,
    )
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    kv_server.close()


def run() -> int:
    args = parse_args()
    try:
        import uvloop
    except ImportError:
        print("fast_engine: uvloop is not installed, running on asyncio", file=sys.stderr)
        asyncio.run(main(args))
    else:
        uvloop.run(main(args))
    return 0


if __name__ == "__main__":
    sys.exit(run())
