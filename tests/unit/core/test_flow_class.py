"""A request's class and fairness key from its headers or its client key (contract 3, 4.5)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from narwhal.core.config import AdmissionConfig
from narwhal.core.faults import BadRequest
from narwhal.core.flow import Priority
from narwhal.core.flow_class import ANONYMOUS, Flow, classify, split_key

HEADER = AdmissionConfig()
BY_KEY = AdmissionConfig(priority_from="key")
TENANT_CHARS = st.sampled_from("abcXYZ019._:-")


def test_a_request_naming_nothing_is_of_the_default_class_and_anonymous() -> None:
    assert classify([], HEADER) == Flow(Priority.DEFAULT, ANONYMOUS)
    batchy = AdmissionConfig(default_class="batch")
    assert classify([], batchy, key_id="abc123") == Flow(Priority.BATCH, "abc123")


@pytest.mark.parametrize("value", [b"interactive", b"default", b"batch", b" Batch "])
def test_the_priority_header_names_the_class(value: bytes) -> None:
    flow = classify([(b"x-narwhal-priority", value)], HEADER)
    assert flow.cls.value == value.strip().lower().decode()


@pytest.mark.parametrize("value", [b"", b"urgent", b"0", b"interactive,batch"])
def test_an_unknown_priority_is_a_400_naming_the_header(value: bytes) -> None:
    with pytest.raises(BadRequest) as caught:
        classify([(b"x-narwhal-priority", value)], HEADER)
    assert caught.value.status == 400
    assert caught.value.message.startswith("x-narwhal-priority:")


@given(st.text(TENANT_CHARS, min_size=1, max_size=128))
def test_a_tenant_of_allowed_characters_is_its_fairness_key(tenant: str) -> None:
    headers = [(b"x-narwhal-tenant", tenant.encode())]
    assert classify(headers, HEADER, key_id="k").tenant == tenant


ALLOWED = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:-")


@given(st.binary(max_size=200))
def test_any_other_tenant_is_a_400_naming_the_header(value: bytes) -> None:
    stripped = value.strip()
    if 1 <= len(stripped) <= 128 and set(stripped) <= ALLOWED:
        assert classify([(b"x-narwhal-tenant", value)], HEADER).tenant == stripped.decode()
        return
    with pytest.raises(BadRequest, match=r"^x-narwhal-tenant:"):
        classify([(b"x-narwhal-tenant", value)], HEADER)


def test_with_priority_from_key_the_key_decides_and_the_header_is_ignored() -> None:
    headers = [(b"x-narwhal-priority", b"interactive")]
    assert classify(headers, BY_KEY, key_class=Priority.BATCH).cls is Priority.BATCH
    assert classify(headers, BY_KEY).cls is Priority.DEFAULT  # a key without a class
    assert classify([(b"x-narwhal-priority", b"bogus")], BY_KEY).cls is Priority.DEFAULT


@pytest.mark.parametrize(
    ("entry", "split"),
    [
        ("interactive:k1", (Priority.INTERACTIVE, "k1")),
        ("batch:a:b", (Priority.BATCH, "a:b")),
        ("k2", (None, "k2")),
        ("gold:k3", (None, "gold:k3")),  # not a class: the whole entry is the key
        ("batch:", (None, "batch:")),
    ],
)
def test_a_key_entry_may_name_its_class(entry: str, split: tuple[Priority | None, str]) -> None:
    assert split_key(entry) == split


@pytest.mark.parametrize(
    "header", [b"x-narwhal-priority", b"x-narwhal-tenant"], ids=["priority", "tenant"]
)
def test_a_header_sent_twice_is_a_400_not_its_last_value(header: bytes) -> None:
    # two field lines mean their values joined by a comma (RFC 9110): "batch, interactive"
    with pytest.raises(BadRequest, match=f"^{header.decode()}:"):
        classify([(header, b"batch"), (header, b"interactive")], HEADER)
