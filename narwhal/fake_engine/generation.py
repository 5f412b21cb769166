"""Deterministic fake generation and vLLM 0.32's response shapes (from real captures).

Tokens are a seeded function of the prompt's token ids alone (and of the request's seed when
it samples), so a prompt decoded after a KV handoff yields exactly what the same prompt
yields served locally, like real vLLM at temperature 0, and a text prompt yields what its
token ids (``prompt_ids``) sent as the prompt yield. As a real model's own output does, the
script also continues: a prompt followed by the first ids its script generates (what a
router sends to resume a stream elsewhere) generates the rest of that script (``script``).

A plain stream's chunk bytes are assembled from precomputed pieces: the fake engine runs
beside the router during benchmarks and must stay cheap. The richer shapes (logprobs, echo,
stop strings, tool calls, ``n``, ...) and every non-streamed answer are built in ``answers``.
"""

from __future__ import annotations

import re
import time
import zlib
from array import array
from collections.abc import Sequence
from typing import Any

import msgspec

VOCAB = (
    " the",
    " quick",
    " brown",
    " fox",
    " jumps",
    " over",
    " lazy",
    " dog",
    "ward",
    "zip",
    " parameters",
    " once",
    " upon",
    " a",
    " time",
    " in",
    " river",
    " stone",
    " light",
    " and",
    " of",
    " to",
    " narwhal",
    " sea",
    " ice",
    " tusk",
    " deep",
    " cold",
    " blue",
    " swims",
    " north",
    " far",
)
_VOCAB_JSON = tuple(msgspec.json.encode(t) for t in VOCAB)
SYSTEM_FINGERPRINT = "vllm-0.32.0-fake0000"
_encode = msgspec.json.encode


GENERATED_ID = 100  # a generated word's token id: its VOCAB index plus this
# the script's linear congruential generator (glibc's rand), 31-bit state
_MULTIPLIER, _INCREMENT, _STATE = 1103515245, 12345, 0x7FFFFFFF


class Script:
    """What the model says after a prompt, word by word: VOCAB indices drawn from a linear
    congruential generator whose state is a pure function of the prompt's token ids (and
    of a sample's key: its seed, see ``asks.Ask.key``)."""

    __slots__ = ("said", "state")

    def __init__(self, state: int, said: int = 0) -> None:
        self.state = state
        self.said = said  # its own words the prompt already ends with (a continuation's)

    def take(self, count: int) -> list[int]:
        """The next ``count`` words (VOCAB indices); the script moves on past them."""
        x, out = self.state, []
        for _ in range(count):
            x = (x * _MULTIPLIER + _INCREMENT) & _STATE
            out.append((x >> 8) % len(VOCAB))
        self.state = x
        return out


def script(prompt: str | Sequence[int], key: int | None = None) -> Script:
    """The script after a prompt (its text, or its token ids). A prompt ``P + G`` where ``G``
    is the first ids ``P``'s own script generates (as reported: index + ``GENERATED_ID``)
    continues that script after ``G``, as a real model at temperature 0 continues its own
    output; the longest such ``G`` wins. Only the trailing run of ids in the generated range
    can be ``G``, and a split that is not one fails at its first word but for 1 in 32, so
    finding the split is linear in the prompt."""
    ids = prompt_ids(prompt) if isinstance(prompt, str) else prompt
    start = _generated_run(ids)
    crc = zlib.crc32(_packed(ids[:start]))
    for split in range(start, len(ids)):
        state = _follows(_seeded(crc, key), ids, split)
        if state is not None:
            return Script(state, len(ids) - split)
        crc = zlib.crc32(_GENERATED_BYTES[ids[split] - GENERATED_ID], crc)
    return Script(_seeded(crc, key))  # crc now hashes every id: a plain prompt


def token_ids(prompt: str | Sequence[int], count: int, key: int | None = None) -> list[int]:
    """``count`` token indices into VOCAB, a pure function of the prompt (see ``script``)."""
    return script(prompt, key).take(count)


def reply_ids(
    prompt: str | Sequence[int], count: int, key: int | None, *, unlimited: bool
) -> list[int]:
    """What a request generates: ``count`` words; with no limit (``unlimited``) the
    script's own end, ``count`` words after the original prompt, as a model stops at its
    end of sequence: a continuation of it ends there too."""
    said = script(prompt, key)
    return said.take(max(0, count - said.said) if unlimited else count)


def generate(prompt: str | Sequence[int], count: int) -> str:
    return "".join(VOCAB[i] for i in token_ids(prompt, count))


def _packed(ids: Sequence[int]) -> bytes:
    """Token ids as fixed-width bytes, so a prompt's hash extends id by id (``script``)."""
    try:
        return array("I", ids).tobytes()
    except OverflowError:  # an id no tokenizer has (negative, over 32 bits): its low bits
        return array("I", [i & 0xFFFFFFFF for i in ids]).tobytes()


_GENERATED_BYTES = tuple(_packed([GENERATED_ID + i]) for i in range(len(VOCAB)))


def _generated_run(ids: Sequence[int]) -> int:
    """Where the trailing run of ids in the generated range begins (``len(ids)``: none)."""
    start = len(ids)
    while start and GENERATED_ID <= ids[start - 1] < GENERATED_ID + len(VOCAB):
        start -= 1
    return start


def _seeded(crc: int, key: int | None) -> int:
    """The generator's first state for a prompt whose ids hash to ``crc``."""
    if key is not None:
        crc = zlib.crc32(b"seed %d" % key, crc)
    return crc or 1


def _follows(x: int, ids: Sequence[int], split: int) -> int | None:
    """The generator's state once the script from ``x`` has said ``ids[split:]`` (None: it
    says something else first). Indexed rather than sliced: each split tried stays
    proportional to the words it matches."""
    for n in range(split, len(ids)):
        x = (x * _MULTIPLIER + _INCREMENT) & _STATE
        if (x >> 8) % len(VOCAB) != ids[n] - GENERATED_ID:
            return None
    return x


def id_list(prompt: Any) -> list[int] | None:
    """A prompt given as token ids, as they are (None: a prompt of some other shape)."""
    if isinstance(prompt, list) and all(type(p) is int for p in prompt):
        return prompt
    return None


def prompt_of(body: dict[str, Any], chat: bool) -> tuple[str, int]:
    """The prompt text and its token count (whitespace words; 4 extra per chat message)."""
    if chat:
        texts, extra = [], 0
        for message in body.get("messages") or []:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):
                content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
            texts.append(str(content or ""))
            extra += 4
        text = "\n".join(texts)
        return text, len(text.split()) + extra
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        if all(isinstance(p, int) for p in prompt):
            return " ".join(map(str, prompt)), len(prompt)
        prompt = " ".join(map(str, prompt))
    text = str(prompt)
    return text, max(1, len(text.split()))


class Shapes:
    """vLLM's JSON for one response (completions or chat), keyed by its id."""

    def __init__(self, resp_id: str, model: str, chat: bool) -> None:
        self.resp_id = resp_id
        self.model = model
        self.chat = chat
        self.created = int(time.time())
        head = {
            "id": resp_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": self.created,
            "model": model,
        }
        self._head = _encode(head)[:-1] + b',"choices":[{"index":0,'
        if chat:
            self._tok_tail = b',"logprobs":null,"finish_reason":null,"token_ids":null}]}'
            self._last_tail = (
                b',"logprobs":null,"finish_reason":"length","stop_reason":null,"token_ids":null}]}'
            )
        else:
            self._tok_tail = (
                b',"logprobs":null,"finish_reason":null,"stop_reason":null,'
                b'"prompt_token_ids":null,"token_ids":null}]}'
            )
            self._last_tail = (
                b',"logprobs":null,"finish_reason":"length","stop_reason":null,'
                b'"prompt_token_ids":null,"token_ids":null}]}'
            )

    def role_chunk(self, prompt_ids: Sequence[int] | None = None) -> bytes:
        """Chat's first chunk; ``prompt_ids`` (asked for by ``return_token_ids``) fills in
        its ``prompt_token_ids``, as vLLM sends them with the role."""
        listed = b"null" if prompt_ids is None else _encode(prompt_ids)
        return self._head + (
            b'"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],'
            b'"prompt_token_ids":' + listed + b',"prompt_text":null}'
        )

    def token_chunk(
        self,
        index: int,
        last: bool,
        with_ids: bool = False,
        prompt_ids: Sequence[int] | None = None,
    ) -> bytes:
        """One token's chunk; ``with_ids`` (the request's ``return_token_ids``) fills in
        ``token_ids`` the way vLLM does instead of null, and ``prompt_ids`` a completion
        choice's ``prompt_token_ids`` (vLLM sends them with the choice's first chunk)."""
        text = _VOCAB_JSON[index]
        body = b'"delta":{"content":' + text + b"}" if self.chat else b'"text":' + text
        ids = b"%d" % (index + GENERATED_ID) if with_ids else None
        return self._head + body + self._tail(last, ids, prompt_ids)

    def group_chunk(
        self,
        texts: list[int],
        ids: list[int],
        last: bool,
        with_ids: bool,
        prompt_ids: Sequence[int] | None = None,
    ) -> bytes:
        """A chunk carrying several tokens (``ids``) and the text of ``texts`` (the tokens
        held back before it and its own), as vLLM sends them when a read finds several
        engine steps done; ``token_ids`` lists the chunk's own tokens."""
        text = _encode("".join(VOCAB[i] for i in texts))
        body = b'"delta":{"content":' + text + b"}" if self.chat else b'"text":' + text
        listed = b",".join(b"%d" % (i + GENERATED_ID) for i in ids) if with_ids else None
        return self._head + body + self._tail(last, listed, prompt_ids)

    def _tail(self, last: bool, ids: bytes | None, prompt_ids: Sequence[int] | None) -> bytes:
        """A token chunk's bytes after its text: ``ids`` (listed, or None: not asked for)
        and, completions only, the prompt's ids."""
        tail = self._last_tail if last else self._tok_tail
        if ids is not None:
            tail = tail.replace(b'"token_ids":null', b'"token_ids":[' + ids + b"]")
        if prompt_ids is not None and not self.chat:
            tail = tail.replace(
                b'"prompt_token_ids":null', b'"prompt_token_ids":' + _encode(prompt_ids)
            )
        return tail

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        usage = {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
        }
        return _encode(
            {
                "id": self.resp_id,
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": usage,
                "system_fingerprint": SYSTEM_FINGERPRINT,
            }
        )


_PROMPT_PIECES = re.compile(r"\s*\S+")


def prompt_pieces(prompt: str) -> list[str]:
    """The prompt's tokens (a word each, with the space before it), together the whole
    text: their offsets are an echo's ``text_offset``."""
    out = _PROMPT_PIECES.findall(prompt)
    if not out:
        return [prompt]
    rest = len(prompt) - sum(map(len, out))
    if rest:
        out[-1] += prompt[-rest:]  # trailing whitespace
    return out


# ASCII that str.split splits on and bytes.split does not (the information separators)
_SEPARATORS = bytes.maketrans(bytes(range(0x1C, 0x20)), b"    ")


def prompt_ids(prompt: str) -> list[int]:
    """The prompt's token ids, as ``/tokenize`` gives them: a word's CRC-32 (the words of
    ``prompt_pieces``), an empty prompt one id of its own. Every request's text goes
    through here once, so ASCII takes the bytes' faster split (the same words)."""
    if prompt.isascii():
        words = prompt.encode().translate(_SEPARATORS).split()
        ids = [crc % 32000 for crc in map(zlib.crc32, words)]
    else:
        ids = [zlib.crc32(w.encode("utf-8", "surrogatepass")) % 32000 for w in prompt.split()]
    return ids or [0]


def prompt_logprobs(prompt: str, top: int) -> list[Any]:
    """vLLM's shape: None for the first prompt token, then for each token a map of token id
    to logprob, rank and text: the prompt's own token first (a prompt is not always what
    the model would have said: its rank runs 1 to 3), then the ``top`` likeliest tokens
    (the own token counted once when it is among them). Deterministic."""
    out: list[Any] = [None]
    pieces = prompt_pieces(prompt)
    for i, (piece, own) in enumerate(zip(pieces, prompt_ids(prompt), strict=True)):
        if not i:
            continue
        best = -round(0.5 + (own % 89) / 40, 4)
        own_rank = 1 + own % 3
        entry = {
            str(own): {
                "logprob": round(best - 0.5 * (own_rank - 1), 4),
                "rank": own_rank,
                "decoded_token": piece,
            }
        }
        for rank in range(1, min(top, len(VOCAB)) + 1):
            if rank == own_rank:
                continue
            other = (own + rank) % len(VOCAB)
            entry[str(32000 + other)] = {
                "logprob": round(best - 0.5 * (rank - 1), 4),
                "rank": rank,
                "decoded_token": VOCAB[other],
            }
        out.append(entry)
    return out


def error_body(message: str, kind: str, code: int, param: str | None = None) -> bytes:
    return _encode({"error": {"message": message, "type": kind, "param": param, "code": code}})


def stream_error_event(
    message: str = "Internal server error", code: int | str | None = 500
) -> bytes:
    """vLLM's in-stream error: note the spaces, it is written by json.dumps, not by pydantic."""
    return (
        b'data: {"error": {"message": '
        + _encode(message)
        + b', "type": "InternalServerError", "param": null, "code": '
        + _encode(code)
        + b"}}\n\ndata: [DONE]\n\n"
    )
