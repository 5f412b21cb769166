"""The generated text kept for the prefix index: joined in pieces, whole at the end."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from narwhal.stream.rules import Reply


@given(st.lists(st.text(min_size=1), max_size=200))
def test_the_reply_is_every_token_text_in_order(texts: list[str]) -> None:
    reply = Reply()
    for text in texts:
        reply.add(text)
    assert reply.text() == "".join(texts)
