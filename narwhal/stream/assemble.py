"""Non-streaming clients are served from a streamed decode: fold its chunks into the JSON a
non-streaming vLLM response has (contract 3, "Completeness"). Pure.

Per choice index:
* chat: ``content``, ``reasoning_content`` and ``refusal`` concatenated; ``tool_calls``
  merged by their ``index`` (``id``, ``type`` and ``function.name`` from the first delta
  that carries them, ``function.arguments`` concatenated); ``logprobs.content`` and
  ``logprobs.refusal`` concatenated;
* completions: ``text`` concatenated; ``logprobs`` ``tokens``, ``token_logprobs``,
  ``top_logprobs`` and ``text_offset`` concatenated (vLLM streams offsets already counted
  from the start of the text);
* ``finish_reason`` and ``stop_reason`` from the chunk that finished the choice, ``token_ids``
  concatenated; any other field of a choice or of the response passes through from the last
  chunk that carried it. ``usage`` is the last one seen.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from narwhal.core.connector import PrefillResult
from narwhal.stream.sse import frame, framed_payloads

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode
# fields folded here, never passed through as they came
_RESPONSE_OWN = frozenset({"id", "object", "created", "model", "choices", "usage"})
_CHAT_DELTA_OWN = frozenset(
    {"role", "content", "reasoning_content", "reasoning", "refusal", "tool_calls"}
)
_CHOICE_OWN = frozenset(
    {"index", "delta", "text", "logprobs", "finish_reason", "stop_reason", "token_ids"}
)
_COMPLETION_LOGPROB_LISTS = (
    "text_offset",
    "token_logprobs",
    "tokens",
    "top_logprobs",
)  # vLLM's order
# vLLM 0.32's non-streaming schema (tests/captures/shapes): fields its streamed chunks leave
# out but a non-streaming client receives, with the values they take there
_TOP_DEFAULTS: dict[str, Any] = {
    "service_tier": None,
    "system_fingerprint": None,
    "kv_transfer_params": None,
    "ec_transfer_params": None,
    "metrics": None,
}
_CHAT_TOP_DEFAULTS = {
    **_TOP_DEFAULTS,
    "prompt_logprobs": None,
    "prompt_token_ids": None,
    "prompt_text": None,
}
_CHOICE_DEFAULTS: dict[str, Any] = {"token_ids": None, "routed_experts": None}
_COMPLETION_CHOICE_DEFAULTS = {
    **_CHOICE_DEFAULTS,
    "prompt_logprobs": None,
    "prompt_token_ids": None,
}
_MESSAGE_DEFAULTS: dict[str, Any] = {
    "refusal": None,
    "annotations": None,
    "audio": None,
    "function_call": None,
}
_USAGE_DEFAULTS: dict[str, Any] = {"prompt_tokens_details": None, "completion_tokens_details": None}


class _ChoiceFold:
    __slots__ = (
        "content",
        "extra",
        "finish_reason",
        "logprobs",
        "logprobs_seen",
        "message_extra",
        "reasoning",
        "reasoning_keys",
        "refusal",
        "stop_reason",
        "token_ids",
        "tool_calls",
    )

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.reasoning_keys: set[str] = set()  # "reasoning" (vLLM 0.32), "reasoning_content"
        self.refusal: list[str] = []
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.logprobs: dict[str, list[Any]] = {}
        self.logprobs_seen = False
        self.token_ids: list[Any] | None = None
        self.finish_reason: Any = None
        self.stop_reason: Any = None
        self.extra: dict[str, Any] = {}  # choice fields the router does not know
        self.message_extra: dict[str, Any] = {}  # delta fields the router does not know

    def add_logprobs(self, logprobs: Any, keys: tuple[str, ...]) -> None:
        if not isinstance(logprobs, dict):
            return
        self.logprobs_seen = True
        for key in keys:
            part = logprobs.get(key)
            if isinstance(part, list):
                self.logprobs.setdefault(key, []).extend(part)

    def add_tool_call(self, delta: dict[str, Any]) -> None:
        index = delta.get("index", len(self.tool_calls))
        call = self.tool_calls.setdefault(
            index if isinstance(index, int) else len(self.tool_calls),
            {"id": None, "type": None, "function": {"name": None, "arguments": ""}},
        )
        for key in ("id", "type"):
            if delta.get(key) and not call[key]:
                call[key] = delta[key]
        function = delta.get("function")
        if isinstance(function, dict):
            if function.get("name") and not call["function"]["name"]:
                call["function"]["name"] = function["name"]
            if isinstance(function.get("arguments"), str):
                call["function"]["arguments"] += function["arguments"]


class Assembler:
    def __init__(self, *, chat: bool, model: str) -> None:
        self.chat = chat
        self.model = model
        self.id = ""
        self.created = 0
        self.usage: Any = None
        self.extra: dict[str, Any] = {}  # response fields the router does not know
        self.choices: dict[int, _ChoiceFold] = {}
        self.prompt_logprobs: Any = None  # from the prefill leg, which computed the prompt
        self.echo: Echo | None = None

    def prompt_side(self, prefill: PrefillResult, asked: Mapping[str, Any]) -> None:
        """What the client asked of the prompt, from the prefill leg that computed it:
        ``prompt_logprobs`` (also implied by ``echo`` with ``logprobs``, as vLLM does) and
        the echoed prompt with its logprobs."""
        self.echo = prompt_echo(prefill, asked, chat=self.chat)
        wants_logprobs = asked.get("logprobs") is not None
        if len(prefill.prompt_logprobs) and (
            asked.get("prompt_logprobs") is not None or (self.echo is not None and wants_logprobs)
        ):
            self.prompt_logprobs = _decode(prefill.prompt_logprobs)

    def add(self, payload: bytes) -> None:
        """One chunk's raw JSON (the relay has checked it); decoded whole here, since the
        relay's narrow struct keeps only what it routes on."""
        data = _decode(payload)
        if not isinstance(data, dict):
            return
        if data.get("id") and not self.id:
            self.id, self.created = data["id"], data.get("created") or 0
        if data.get("usage") is not None:
            self.usage = data["usage"]
        for key, value in data.items():
            if key not in _RESPONSE_OWN and (value is not None or key not in self.extra):
                self.extra[key] = value
        for choice in data.get("choices") or ():
            if isinstance(choice, dict):
                self._add_choice(choice)

    def _add_choice(self, choice: dict[str, Any]) -> None:
        index = choice.get("index", 0)
        fold = self.choices.setdefault(index if isinstance(index, int) else 0, _ChoiceFold())
        if self.chat:
            delta = choice.get("delta")
            if isinstance(delta, dict):
                self._add_delta(fold, delta)
            fold.add_logprobs(choice.get("logprobs"), ("content", "refusal"))
        else:
            if isinstance(choice.get("text"), str):
                fold.content.append(choice["text"])
            fold.add_logprobs(choice.get("logprobs"), _COMPLETION_LOGPROB_LISTS)
        if isinstance(choice.get("token_ids"), list):
            fold.token_ids = (fold.token_ids or []) + choice["token_ids"]
        if choice.get("finish_reason") is not None:
            fold.finish_reason = choice["finish_reason"]
            fold.stop_reason = choice.get("stop_reason")
        for key, value in choice.items():
            # a field sent once (the first chunk's prompt_token_ids) and null after it
            # keeps its value: a null never replaces one
            if key not in _CHOICE_OWN and (value is not None or key not in fold.extra):
                fold.extra[key] = value

    @staticmethod
    def _add_delta(fold: _ChoiceFold, delta: dict[str, Any]) -> None:
        if isinstance(delta.get("content"), str):
            fold.content.append(delta["content"])
        for key in ("reasoning", "reasoning_content"):
            if isinstance(delta.get(key), str):
                fold.reasoning.append(delta[key])
                fold.reasoning_keys.add(key)
                break
        if isinstance(delta.get("refusal"), str):
            fold.refusal.append(delta["refusal"])
        for call in delta.get("tool_calls") or ():
            if isinstance(call, dict):
                fold.add_tool_call(call)
        for key, value in delta.items():
            if key not in _CHAT_DELTA_OWN:
                fold.message_extra[key] = value

    def body(self) -> bytes:
        choices = [self._choice(i, fold) for i, fold in sorted(self.choices.items())]
        if not choices:
            choices = [self._choice(0, _ChoiceFold())]
        usage = self.usage
        if isinstance(usage, dict):
            usage = {**_USAGE_DEFAULTS, **usage}
        response: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **(_CHAT_TOP_DEFAULTS if self.chat else _TOP_DEFAULTS),
            **self.extra,
            "usage": usage,
        }
        if self.chat and self.prompt_logprobs is not None:
            response["prompt_logprobs"] = self.prompt_logprobs
        return _encode(response)

    def _choice(self, index: int, fold: _ChoiceFold) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            message: dict[str, Any] = {
                "role": "assistant",
                # a stream that carried content, even "" (vLLM's opening delta), has content
                "content": "".join(fold.content) if fold.content else None,
                **_MESSAGE_DEFAULTS,
                "refusal": "".join(fold.refusal) if fold.refusal else None,
                "reasoning": None,
                **fold.message_extra,
            }
            if fold.tool_calls:  # vLLM leaves the key out when there are none
                message["tool_calls"] = [fold.tool_calls[k] for k in sorted(fold.tool_calls)]
            for key in fold.reasoning_keys:
                message[key] = "".join(fold.reasoning)
            choice["message"] = message
        else:
            choice["text"] = "".join(fold.content)
        choice["logprobs"] = dict(fold.logprobs) if fold.logprobs_seen else None
        if self.echo is not None:
            self.echo.apply(choice)
        choice["finish_reason"] = fold.finish_reason
        choice["stop_reason"] = fold.stop_reason
        choice.update(_CHOICE_DEFAULTS if self.chat else _COMPLETION_CHOICE_DEFAULTS)
        choice.update(fold.extra)
        choice["token_ids"] = fold.token_ids
        if self.echo is not None and self.echo.prompt_ids is not None:
            choice["prompt_token_ids"] = self.echo.prompt_ids
        if not self.chat and self.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.prompt_logprobs
        return choice


class Echo:
    """An echoed prompt (completions): the text and logprobs the producer gave the prompt,
    put before the consumer's generated text, offsets continued (vLLM's own shape)."""

    __slots__ = ("base", "logprobs", "pending", "prompt_ids", "text", "with_logprobs")

    def __init__(
        self, text: str, logprobs: dict[str, list[Any]] | None, base: int, with_logprobs: bool
    ) -> None:
        self.text = text
        self.logprobs = logprobs  # the prompt's entries only
        self.base = base  # where the generated text starts in vLLM's offsets
        self.with_logprobs = with_logprobs
        self.pending = True  # a stream: the prompt still goes before the next output
        # the prompt's token ids as the producer gave them (``return_token_ids``); vLLM puts
        # them in an echo's first chunk, and the decode leg never computes the prompt
        self.prompt_ids: Any = None

    def stream(self, data: bytes) -> bytes:
        """A streaming client's frames as vLLM streams an echo: the prompt (and its
        logprobs) in the first output chunk, every later offset continued."""
        frames = []
        for payload in framed_payloads(data):
            if not payload.startswith(b"{"):
                frames.append(frame(payload))
                continue
            chunk = _decode(payload)
            choices = chunk.get("choices") if isinstance(chunk, dict) else None
            for choice in choices or ():
                if not isinstance(choice, dict):
                    continue
                if self.pending:
                    self.pending = False
                    choice["text"] = self.text + (choice.get("text") or "")
                    if self.prompt_ids is not None:
                        choice["prompt_token_ids"] = self.prompt_ids
                    if self.with_logprobs and isinstance(choice.get("logprobs"), dict):
                        self._merge(choice)
                        continue
                self._shift(choice)
            frames.append(frame(_encode(chunk) if choices else payload))
        return b"".join(frames)

    def _merge(self, choice: dict[str, Any]) -> None:
        generated = choice["logprobs"]
        merged: dict[str, list[Any]] = {}
        for key in _COMPLETION_LOGPROB_LISTS:
            tail = list(generated.get(key) or [])
            if key == "text_offset":
                tail = [self.base + offset for offset in tail]
            merged[key] = list((self.logprobs or {}).get(key) or []) + tail
        choice["logprobs"] = merged

    def _shift(self, choice: dict[str, Any]) -> None:
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict) and isinstance(logprobs.get("text_offset"), list):
            logprobs["text_offset"] = [self.base + o for o in logprobs["text_offset"]]

    def apply(self, choice: dict[str, Any]) -> None:
        """A non-streaming answer's choice."""
        choice["text"] = self.text + choice["text"]
        if self.with_logprobs and self.logprobs is not None:
            choice["logprobs"] = choice["logprobs"] or {}
            self._merge(choice)


def prompt_echo(prefill: PrefillResult, asked: Mapping[str, Any], *, chat: bool) -> Echo | None:
    """The echo a client asked for (completions only), streamed or not."""
    if chat or not asked.get("echo"):
        return None
    echo = echo_of(prefill, asked.get("prompt"), with_logprobs=asked.get("logprobs") is not None)
    if asked.get("return_token_ids") is True and len(prefill.prompt_token_ids):
        echo.prompt_ids = _decode(prefill.prompt_token_ids)
    return echo


def echo_of(prefill: PrefillResult, prompt: Any, *, with_logprobs: bool) -> Echo:
    """The prompt part of the producer's echoed answer: its text is the prompt and the one
    token the producer generated, the last entry of its logprobs."""
    text = prefill.text or ""
    logprobs = _decode(prefill.logprobs) if len(prefill.logprobs) else None
    if not isinstance(logprobs, dict) or not logprobs.get("tokens"):
        return Echo(prompt if isinstance(prompt, str) else text, None, 0, with_logprobs)
    last = logprobs["tokens"][-1]
    prompt_text = text[: len(text) - len(last)] if text.endswith(last) else text
    offsets = logprobs.get("text_offset") or [len(prompt_text)]
    prompt_part = {k: list(v[:-1]) for k, v in logprobs.items() if isinstance(v, list)}
    return Echo(prompt_text, prompt_part, offsets[-1], with_logprobs)
