"""The fake engine's script, sans I/O: a function of the prompt's token ids that a stream
resumed elsewhere continues (the router's continuation: the prompt's ids and the ids the
client already has, over ``/v1/completions``), and the prompt's ids on a stream where vLLM
puts them."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from narwhal.core import resume
from narwhal.fake_engine import answers, asks
from narwhal.fake_engine import generation as gen
from narwhal.fake_engine.samples import samples
from tests.support.token_streams import StreamRead, read_plan

MODEL = "tiny"
FIRST, LAST = gen.GENERATED_ID, gen.GENERATED_ID + len(gen.VOCAB) - 1

_TEXT = st.lists(
    st.sampled_from(["the", "ice", "narwhal", "a", "é", "x\ny", "7", "42", "\t"]),
    min_size=1,
    max_size=12,
).map(" ".join)
# token ids, many of them in the generated range: a prompt that ends like a continuation
_IDS = st.lists(st.one_of(st.integers(0, 31_999), st.integers(FIRST, LAST)), min_size=1)
_SAMPLING = st.one_of(
    st.just({"temperature": 0}),
    st.integers(0, 2**31).map(lambda seed: {"temperature": 0.8, "seed": seed}),
)


# how a stream's tokens go out: one a chunk, grouped (0: a token whose text is held back,
# see answers.grouped_frames), or None: the general path (answers.stream_plan)
_PATHS: tuple[tuple[int, ...] | None, ...] = ((), (0, 2, 1), (3,), None)


def _plan(body: dict[str, Any], chat: bool, path: tuple[int, ...] | None) -> answers.StreamPlan:
    ask = asks.ask_of({"model": MODEL, **body}, chat, 16)
    shapes = gen.Shapes("cmpl-x", MODEL, chat)
    if path is None:
        return answers.stream_plan(ask, shapes, samples(ask))
    [prompt] = ask.prompts
    ids = gen.token_ids(prompt.ids, ask.max_tokens, ask.key(0))
    return answers.plain_plan(
        ask, shapes, ids, finished=True, prompt_tokens=prompt.count, chunk_tokens=path
    )


def _stream(body: dict[str, Any], chat: bool, path: tuple[int, ...] | None = ()) -> StreamRead:
    """The stream the fake engine writes for ``body``, read whole."""
    return read_plan(_plan(body, chat, path))


def _original(prompt: str | list[int], chat: bool, n: int, sampling: dict[str, Any]) -> Any:
    body: dict[str, Any] = {
        "max_tokens": n,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
        **sampling,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


@st.composite
def _cases(draw: st.DrawFn) -> tuple[str | list[int], bool, int, int, dict[str, Any]]:
    chat = draw(st.booleans())
    prompt = draw(_TEXT if chat else st.one_of(_TEXT, _IDS))
    n = draw(st.integers(1, 40))
    return prompt, chat, n, draw(st.integers(0, n - 1)), draw(_SAMPLING)


@given(_cases())
def test_a_continuation_generates_the_rest_of_the_script(
    case: tuple[str | list[int], bool, int, int, dict[str, Any]],
) -> None:
    """The stream that continues after ``k`` tokens the client has is the rest of the
    stream it would have read: no token repeated, none missing, the text the same."""
    prompt, chat, n, k, sampling = case
    body = _original(prompt, chat, n, sampling)
    whole = _stream(body, chat)
    assert whole == _stream(body, chat, (0, 2, 1))  # every id, held back or not
    assert whole.prompt_ids is not None
    assert len(whole.ids) == n
    sent = whole.ids[:k]
    asked = resume.continuation(body, chat=chat, prompt_ids=whole.prompt_ids, sent_ids=sent)
    for path in _PATHS:
        rest = _stream({**asked, "stream_options": {"include_usage": True}}, False, path)
        assert rest.ids == whole.ids[k:]
        assert "".join(gen.VOCAB[i - FIRST] for i in sent) + rest.text == whole.text
        assert rest.prompt_ids == whole.prompt_ids + sent
        assert rest.usage is not None
        assert rest.usage["prompt_tokens"] == len(whole.prompt_ids) + k
        assert rest.usage["completion_tokens"] == n - k


@given(_TEXT, _SAMPLING)
def test_a_text_prompt_says_what_its_token_ids_say(text: str, sampling: dict[str, Any]) -> None:
    """The script is a function of the prompt's ids: the text, its ids as the prompt, and
    a chat message of that text all read the same (chat's ids are its messages' words)."""
    by_text = _stream(_original(text, False, 12, sampling), False)
    by_ids = _stream(_original(gen.prompt_ids(text), False, 12, sampling), False)
    by_chat = _stream(_original(text, True, 12, sampling), True)
    assert by_text.prompt_ids == by_ids.prompt_ids == by_chat.prompt_ids == gen.prompt_ids(text)
    assert (by_text.ids, by_text.text) == (by_ids.ids, by_ids.text) == (by_chat.ids, by_chat.text)
    key = sampling.get("seed")
    assert by_text.ids == [i + FIRST for i in gen.token_ids(text, 12, key)]


def test_ids_that_are_not_the_script_are_a_prompt_like_any_other() -> None:
    """Trailing ids in the generated range that the prompt's script does not say: no
    continuation, a fresh script for the whole list."""
    prompt = gen.prompt_ids("a narwhal swims north under the ice")
    said = [i + FIRST for i in gen.token_ids(prompt, 6)]
    wrong = [*said[:3], FIRST + (said[3] - FIRST + 1) % len(gen.VOCAB)]
    assert gen.token_ids(prompt + wrong, 3) != gen.token_ids(prompt, 6)[3:]
    assert gen.token_ids(prompt + wrong, 3) == gen.token_ids(tuple(prompt + wrong), 3)


def test_a_prompt_that_continues_another_is_continued_as_that_one() -> None:
    """The longest continuation wins, so continuing a prompt that is itself (by chance) a
    continuation continues the first prompt's script: a continuation of a continuation."""
    first = gen.prompt_ids("a narwhal swims north under the ice")
    script = gen.token_ids(first, 10)
    said = [i + FIRST for i in script]
    second = first + said[:1]
    assert gen.token_ids(second, 9) == script[1:]
    assert gen.token_ids(second + said[1:4], 6) == script[4:]


def test_a_long_continuation_continues() -> None:
    """A prompt of thousands of words continued after thousands of tokens (a long stream
    resumed late): the split is found in one pass, the rest of the script follows."""
    prompt = gen.prompt_ids(" ".join(f"w{i}" for i in range(4000)))
    said = gen.token_ids(prompt, 6000)
    asked = prompt + [i + FIRST for i in said[:5000]]
    assert gen.token_ids(asked, 1000) == said[5000:]


# ---- prompt_token_ids on a stream ----------------------------------------------------------


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize(("path", "n"), [((), 1), ((0, 2, 1), 1), (None, 1), (None, 2)])
def test_the_prompt_ids_go_out_once_per_choice_where_vllm_sends_them(
    chat: bool, path: tuple[int, ...] | None, n: int
) -> None:
    """vLLM with ``return_token_ids``: chat sends the prompt's ids at the top level of each
    choice's role chunk, completions on each choice's first chunk (one whose text is held
    back too); every token chunk lists its ids."""
    prompt = "The quick brown fox jumps over the lazy dog"
    messages = [{"role": "user", "content": prompt}]
    body: dict[str, Any] = {"messages": messages} if chat else {"prompt": prompt}
    body.update(max_tokens=6, return_token_ids=True, temperature=0.7, seed=3, n=n)
    read = _stream(body, chat, path)
    assert read.prompt_ids == gen.prompt_ids(prompt)
    assert read.placements == [(j, "top" if chat else "choice") for j in range(n)]
    assert len(read.ids) == 6 * n
    body["return_token_ids"] = False
    unasked = _stream(body, chat, path)
    assert (unasked.placements, unasked.ids) == ([], [])


def test_a_token_id_prompt_reports_its_own_ids() -> None:
    """A prompt sent as ids comes back as those ids (vLLM does not tokenize it again)."""
    ids = [1, 45, 99, FIRST + 3]
    body = {"prompt": ids, "max_tokens": 3, "return_token_ids": True}
    assert _stream(body, False).prompt_ids == ids
    [choice] = samples(asks.ask_of({"model": MODEL, **body}, False, 16))
    assert list(choice.prompt.ids) == ids
