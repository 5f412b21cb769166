"""The approximate prefix index (contract 4.4): what the router believes each engine caches."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from narwhal.core.prefix_index import (
    BLOCK_BYTES,
    BLOCK_TOKENS,
    MAX_PROMPT_BLOCKS,
    PrefixIndex,
    prompt_of,
    reply_text,
    text_blocks,
    token_blocks,
)

texts = st.text(alphabet=st.characters(codec="utf-8"), max_size=2000)
cuts = st.integers(min_value=0, max_value=2000)


@given(texts, cuts)
def test_a_prefix_of_a_recorded_text_matches_its_full_blocks(text: str, cut: int) -> None:
    data = text.encode()
    index = PrefixIndex(ttl_s=60.0)
    index.record("e", text_blocks(data), 0.0)
    prefix = data[:cut]
    assert index.match("e", text_blocks(prefix), 1.0) == len(prefix) // BLOCK_BYTES


@given(texts, texts)
def test_different_texts_match_only_their_common_full_blocks(a: str, b: str) -> None:
    x, y = a.encode(), b.encode()
    index = PrefixIndex(ttl_s=60.0)
    index.record("e", text_blocks(x), 0.0)
    common = 0
    while common < min(len(x), len(y)) and x[common] == y[common]:
        common += 1
    assert index.match("e", text_blocks(y), 0.0) == common // BLOCK_BYTES


@given(st.lists(texts, max_size=12), st.integers(min_value=1, max_value=40))
def test_each_engine_holds_at_most_its_bound(recorded: list[str], bound: int) -> None:
    index = PrefixIndex(ttl_s=60.0, max_blocks=bound)
    for text in recorded:
        index.record("e", text_blocks(text.encode()), 0.0)
        assert index.size("e") <= bound
    if recorded:  # the last text's head is the most recent: it is kept first
        last = text_blocks(recorded[-1].encode())
        assert index.match("e", last, 0.0) == min(len(last), bound)


@given(texts, st.floats(min_value=0.1, max_value=100.0))
def test_entries_expire_after_the_ttl(text: str, ttl: float) -> None:
    blocks = text_blocks(text.encode())
    index = PrefixIndex(ttl_s=ttl)
    index.record("e", blocks, 10.0)
    assert index.match("e", blocks, 10.0 + ttl * 0.99) == len(blocks)
    # just past the TTL (exactly at it, 10.0 + ttl - ttl may round below 10.0)
    assert index.match("e", blocks, 10.0 + ttl * 1.0001) == 0
    index.record("e", text_blocks(b"x" * BLOCK_BYTES), 10.0 + ttl * 1.0001)  # it sweeps them
    assert index.size("e") <= 1


def test_the_next_chat_turn_matches_the_turn_and_its_reply() -> None:
    turn = [
        {"role": "system", "content": "You are terse. " * 20},
        {"role": "user", "content": "Tell me about whales. " * 10},
    ]
    reply = "Whales are large marine mammals. " * 8
    held = prompt_of({"messages": turn}, chat=True).followed_by(reply_text(reply, chat=True))
    index = PrefixIndex(ttl_s=60.0)
    index.record("d0", held.blocks, 0.0)
    nxt = [*turn, {"role": "assistant", "content": reply}, {"role": "user", "content": "More"}]
    asked = prompt_of({"messages": nxt}, chat=True)
    assert index.match("d0", asked.blocks, 1.0) == len(held.blocks)
    assert asked.uncached(len(held.blocks)) < 2 * BLOCK_TOKENS  # the new message, about


def test_token_prompts_count_exactly_and_never_match_text() -> None:
    ids = list(range(100))
    prompt = prompt_of({"prompt": ids}, chat=False)
    assert prompt.tokens == 100
    assert prompt.blocks == token_blocks(ids)
    assert len(prompt.blocks) == 100 // BLOCK_TOKENS
    text = prompt_of({"prompt": "a" * 400}, chat=False)
    assert text.tokens == 100  # 400 bytes / 4
    index = PrefixIndex(ttl_s=60.0)
    index.record("e", prompt.blocks, 0.0)
    assert index.match("e", text.blocks, 0.0) == 0
    index.record("e", text.blocks, 0.0)
    assert index.match("e", prompt.blocks, 0.0) == len(prompt.blocks)


def test_an_engine_forgotten_or_removed_holds_nothing() -> None:
    blocks = text_blocks(b"y" * 640)
    index = PrefixIndex(ttl_s=60.0)
    for engine in ("a", "b", "c"):
        index.record(engine, blocks, 0.0)
    index.forget("a")
    index.keep_only(["a", "c"])
    assert [index.match(e, blocks, 0.0) for e in "abc"] == [0, 0, 10]


@given(texts, texts)
def test_a_text_followed_by_more_hashes_as_the_whole(head: str, more: str) -> None:
    whole = prompt_of({"prompt": head + more}, chat=False)
    followed = prompt_of({"prompt": head}, chat=False).followed_by(more)
    assert followed.blocks == whole.blocks


def test_what_a_template_renders_weighs_in_the_estimate() -> None:
    user = {"role": "user", "content": "hi"}
    bare = prompt_of({"messages": [user]}, chat=True).tokens
    tools = [{"type": "function", "function": {"name": "f", "description": "d" * 20_000}}]
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 30_000}}
    calls = [{"id": "c", "type": "function", "function": {"arguments": "x" * 30_000}}]
    heavy = [
        {"messages": [user], "tools": tools},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}]},
        {"messages": [user, {"role": "assistant", "content": None, "tool_calls": calls}]},
    ]
    for body in heavy:
        assert prompt_of(body, chat=True).tokens > bare + 4_000


def test_a_huge_prompt_is_hashed_only_so_far_but_counted_whole() -> None:
    data = "z" * (BLOCK_BYTES * (MAX_PROMPT_BLOCKS + 100))
    prompt = prompt_of({"prompt": data}, chat=False)
    assert len(prompt.blocks) == MAX_PROMPT_BLOCKS
    assert prompt.tokens == len(data) // 4
    assert prompt.followed_by("more text").blocks == prompt.blocks
