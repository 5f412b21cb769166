"""What one completion request asks of the fake engine (``Ask``): its prompts, its limit,
``n``, sampling (greedy, seeded), logprobs, echo, stop strings, a forced tool call, a JSON
schema, usage and token ids, read from the request's body as vLLM 0.32 reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from narwhal.fake_engine import generation as gen
from narwhal.fake_engine import lora

GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it samples greedily


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str
    count: int  # its tokens, as usage counts them
    # its token ids as ``prompt_token_ids`` reports them, what its samples are a function of
    ids: tuple[int, ...]


def prompts_of(body: dict[str, Any], chat: bool) -> list[Prompt]:
    """The request's prompts: one, or each of a completions list of prompts (strings or
    token-id lists), each read as the router's fan-out sends it alone."""
    prompt = body.get("prompt")
    if not chat and isinstance(prompt, list) and len(prompt) > 1 and gen.id_list(prompt) is None:
        return [_prompt({"prompt": p}, False) for p in prompt]
    return [_prompt(body, chat)]


def _prompt(body: dict[str, Any], chat: bool) -> Prompt:
    """One prompt; its ids are computed here, once a request (a long prompt's cost)."""
    text, count = gen.prompt_of(body, chat)
    given = None if chat else gen.id_list(body.get("prompt"))
    return Prompt(text, count, tuple(gen.prompt_ids(text) if given is None else given))


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    parameters: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Ask:
    """What one completion request asks of the engine."""

    chat: bool
    prompts: tuple[Prompt, ...]
    max_tokens: int
    n: int = 1
    greedy: bool = False
    seed: int | None = None
    logprobs: int | None = None  # alternatives per token (chat: top_logprobs); None: not asked
    echo: bool = False
    prompt_logprobs: int | None = None
    stop: tuple[str, ...] = ()
    tool: Tool | None = None  # a function the request forces (named, or "required")
    schema: dict[str, Any] | None = None  # response_format's JSON schema
    include_usage: bool = False
    continuous_usage: bool = False
    return_token_ids: bool = False
    # no limit (a chat without one, or one at the context's end): the script ends at the
    # default length after the original prompt, as a model stops at its end of sequence
    unlimited: bool = False
    adapter: str | None = None  # the LoRA adapter it runs under (None: the base model)

    @property
    def plain(self) -> bool:
        """Served by ``Shapes``' precomputed bytes when streamed."""
        return (
            self.n == 1
            and len(self.prompts) == 1
            and self.logprobs is None
            and not self.echo
            and not self.stop
            and self.tool is None
            and self.schema is None
            and not self.continuous_usage
        )

    def key(self, j: int) -> int | None:
        """What sample ``j`` (of ``n``) is a function of, beside the prompt: under an
        adapter, the adapter too (``lora.generation_salt``)."""
        if self.greedy:
            key = None
        elif self.seed is not None:
            key = self.seed + j
        else:
            key = j or None
        return key if self.adapter is None else lora.generation_salt(self.adapter, key)


def ask_of(
    body: dict[str, Any],
    chat: bool,
    default_max_tokens: int,
    context: int = 1 << 62,
    *,
    adapter: str | None = None,
) -> Ask:
    """``context``: the engine's max_model_len; a limit that reaches its end is none.
    ``adapter``: the LoRA adapter the request runs under."""
    limit = body.get("max_completion_tokens") if chat else None
    count = limit or body.get("max_tokens") or default_max_tokens
    temperature = body.get("temperature")
    seed = body.get("seed")
    n = body.get("n")
    options = body.get("stream_options")
    if not isinstance(options, dict):
        options = {}
    usage = options.get("include_usage") is True
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    prompts = tuple(prompts_of(body, chat))
    to_end = type(count) is int and prompts[0].count + count >= context
    return Ask(
        chat=chat,
        prompts=prompts,
        max_tokens=count if type(count) is int and not to_end else default_max_tokens,
        n=n if type(n) is int and n > 1 else 1,
        greedy=isinstance(temperature, int | float) and temperature < GREEDY_BELOW,
        seed=seed if type(seed) is int else None,
        logprobs=_logprobs_asked(body, chat),
        echo=not chat and body.get("echo") is True,
        prompt_logprobs=_count(body.get("prompt_logprobs")),
        stop=tuple(s for s in stop if isinstance(s, str) and s) if isinstance(stop, list) else (),
        tool=_forced_tool(body) if chat else None,
        schema=_schema(body.get("response_format")),
        include_usage=usage,
        continuous_usage=usage and options.get("continuous_usage_stats") is True,
        return_token_ids=body.get("return_token_ids") is True,
        unlimited=to_end or (chat and not limit and body.get("max_tokens") is None),
        adapter=adapter,
    )


def _count(value: Any) -> int | None:
    """A number of alternatives; -1 is the whole vocabulary, as vLLM reads it."""
    if type(value) is not int:
        return None
    return len(gen.VOCAB) if value < 0 else value


def _logprobs_asked(body: dict[str, Any], chat: bool) -> int | None:
    if not chat:
        return _count(body.get("logprobs"))
    if body.get("logprobs") is not True:
        return None
    return _count(body.get("top_logprobs")) or 0


def _forced_tool(body: dict[str, Any]) -> Tool | None:
    listed = body.get("tools")
    tools = (
        [t.get("function") for t in listed if isinstance(t, dict)]
        if isinstance(listed, list)
        else []
    )
    functions = [f for f in tools if isinstance(f, dict) and isinstance(f.get("name"), str)]
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        wanted = choice["function"].get("name")
        functions = [f for f in functions if f["name"] == wanted]
    elif choice != "required":
        return None
    if not functions:
        return None
    parameters = functions[0].get("parameters")
    return Tool(functions[0]["name"], parameters if isinstance(parameters, dict) else {})


def _schema(response_format: Any) -> dict[str, Any] | None:
    if not isinstance(response_format, dict):
        return None
    if response_format.get("type") == "json_object":
        return {"type": "object"}
    spec = response_format.get("json_schema")
    if response_format.get("type") == "json_schema" and isinstance(spec, dict):
        schema = spec.get("schema")
        return schema if isinstance(schema, dict) else {"type": "object"}
    return None
