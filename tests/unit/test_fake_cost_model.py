"""The fake engine's cost model on the consumer side, sans I/O: the tokens a finished reply
leaves in the prefix cache, the blocks a pull moves, and what a pull, prefill interference
and a bigger decode batch cost."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import assume, given
from hypothesis import strategies as st

from narwhal.fake_engine import cost
from narwhal.fake_engine import generation as gen

# a reply as the fake streams it: vocabulary pieces, some with no space before them
_REPLIES = st.lists(st.sampled_from(gen.VOCAB), max_size=40).map("".join)
_TEXT = st.lists(st.sampled_from(["a", "b", "word", "x\ny", " ", "\t"]), max_size=30).map(" ".join)


@given(st.lists(_TEXT, min_size=1, max_size=4), _REPLIES, _TEXT)
def test_a_chat_reply_is_cached_as_the_next_turn_sends_it(
    contents: list[str], reply: str, follow_up: str
) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": c} for c in contents]
    body = {"messages": messages}
    cached = cost.reply_tokens(body, True, "", reply)
    assistant = {"role": "assistant", "content": reply}
    next_turn = {"messages": [*messages, assistant, {"role": "user", "content": follow_up}]}
    assert cost.prompt_tokens(next_turn, True)[: len(cached)] == cached
    assert cached[: len(cost.prompt_tokens(body, True))] == cost.prompt_tokens(body, True)


@given(_TEXT, _REPLIES, _TEXT)
def test_a_completions_reply_is_cached_as_prompt_and_text(
    prompt: str, reply: str, more: str
) -> None:
    assume((prompt + reply).split())  # an empty prompt is one token of its own
    cached = cost.reply_tokens({"prompt": prompt}, False, prompt, reply)
    assert cached == cost.prompt_tokens({"prompt": prompt + reply}, False)
    sent_back = cost.prompt_tokens({"prompt": prompt + reply + " " + more}, False)
    assert sent_back[: len(cached)] == cached


def test_a_reply_that_continues_the_last_word_is_one_token_with_it() -> None:
    tokens = cost.reply_tokens({"prompt": "go fox"}, False, "go fox", "ward the")
    assert tokens == cost.prompt_tokens({"prompt": "go foxward the"}, False)
    assert len(tokens) == 3


def test_a_prompt_of_token_ids_keeps_its_ids() -> None:
    tokens = cost.reply_tokens({"prompt": [5, 6, 7]}, False, "5 6 7", " the fox")
    assert tokens[:3] == [5, 6, 7]
    assert tokens[3:] == cost.prompt_tokens({"prompt": "the fox"}, False)


def test_probe_tells_the_hit_from_the_blocks_held() -> None:
    cache = cost.PrefixCache(16)
    cache.insert(list(range(32)))
    # every block held, yet the hit leaves the last token (so its block) to compute
    assert cache.probe(list(range(32))) == (16, 2)
    assert cache.probe(list(range(40))) == (32, 2)  # a partial last block is never held
    assert cache.probe([*range(16), -1, *range(17, 32)]) == (16, 1)
    assert cache.probe([]) == (0, 0)
    assert (cache.queries, cache.hits) == (104, 64)
    assert cost.PrefixCache(0).probe(list(range(32))) == (0, 0)


def test_a_descriptor_names_every_block_of_the_prompt() -> None:
    assert [cost.prompt_blocks(n) for n in (0, 1, 16, 17, 32)] == [1, 1, 1, 2, 2]


def test_a_pull_costs_its_fixed_delay_and_each_block_moved() -> None:
    assert cost.pull_seconds(0, 0.5, 250) == 0.5
    assert cost.pull_seconds(4, 0.5, 250) == 1.5
    assert cost.pull_seconds(4, 0.0, 0.0) == 0.0


def test_interference_grows_with_the_prompts_computing() -> None:
    assert cost.interfered_itl(0.5, 1.0, 0) == 0.5
    assert cost.interfered_itl(0.5, 1.0, 2) == 1.5
    assert cost.interfered_itl(0.5, 0.25, 2) == 0.75


def test_a_decode_step_grows_with_the_other_streams_in_the_batch() -> None:
    assert cost.batched_itl(0.02, 0.5, 1) == 0.02  # alone: the engine's own pace
    assert cost.batched_itl(0.02, 0.5, 3) == 0.04
    assert cost.batched_itl(0.02, 0.0, 100) == 0.02  # off: the batch does not matter
    assert cost.batched_itl(0.02, 0.5, 0) == 0.02  # never faster than alone


_ITL = st.floats(0, 10, allow_nan=False)
_GROWTH = st.floats(0, 4, allow_nan=False)


@given(_ITL, _GROWTH, st.integers(0, 500), st.integers(0, 500))
def test_a_bigger_batch_is_never_faster(itl: float, growth: float, a: int, b: int) -> None:
    small, big = sorted((a, b))
    assert itl <= cost.batched_itl(itl, growth, small) <= cost.batched_itl(itl, growth, big)


@given(_ITL, _GROWTH, st.integers(1, 500))
def test_the_step_is_linear_in_the_batch(itl: float, growth: float, decoding: int) -> None:
    expected = itl + itl * growth * (decoding - 1)
    assert math.isclose(cost.batched_itl(itl, growth, decoding), expected, abs_tol=1e-12)


def test_a_block_is_two_mebibytes_of_nominal_kv() -> None:
    assert cost.KV_BYTES_PER_BLOCK == 2 * 1024 * 1024
