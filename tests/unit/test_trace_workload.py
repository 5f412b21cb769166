"""The trace replay's prompts (bench/trace_workload.py) under the fake engine's tokenizer:
requests that share leading hash ids share exactly those blocks' tokens and no more, every
prompt is as long as its scaled input, and the ideal work is what an unbounded prefix cache
of the fake engine leaves to compute."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from narwhal.fake_engine import cost

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
import trace_workload as tw  # bench/ is not a package: found through the path above

SCALES = st.sampled_from([tw.Scale(f) for f in (1 / 32, 1 / 16, 1 / 8)])


@st.composite
def requests(draw: st.DrawFn, count: int = 4) -> list[tw.TraceRequest]:
    """Requests whose ids branch off each other's prefixes, as conversations do: each
    takes a leading run of an earlier one's ids, then ids of its own."""
    out: list[tw.TraceRequest] = []
    fresh = 1000
    for n in range(draw(st.integers(1, count))):
        ids: list[int] = []
        if out:
            parent = draw(st.sampled_from(out)).hash_ids
            ids = list(parent[: draw(st.integers(0, len(parent)))])
        for _ in range(draw(st.integers(0 if ids else 1, 3))):
            ids.append(fresh)
            fresh += 1
        last = draw(st.integers(1, tw.TRACE_BLOCK))
        length = (len(ids) - 1) * tw.TRACE_BLOCK + last
        out.append(tw.TraceRequest(n, length, draw(st.integers(1, 2000)), tuple(ids)))
    return out


def _tokens(req: tw.TraceRequest, scale: tw.Scale) -> list[int]:
    return cost.prompt_tokens({"prompt": tw.prompt_text(req, scale, {})}, False)


@given(requests(), SCALES)
def test_every_prompt_is_its_scaled_input_long(
    reqs: list[tw.TraceRequest], scale: tw.Scale
) -> None:
    for req in reqs:
        assert len(_tokens(req, scale)) == scale.input_tokens(req)
        assert scale.input_tokens(req) <= len(req.hash_ids) * scale.block_words


@given(requests(), SCALES)
def test_shared_ids_share_exactly_their_blocks(
    reqs: list[tw.TraceRequest], scale: tw.Scale
) -> None:
    first, *rest = reqs
    a = cost.block_hashes(_tokens(first, scale))
    per_id = scale.block_words // tw.ENGINE_BLOCK
    for other in rest:
        b = cost.block_hashes(_tokens(other, scale))
        shared_ids = 0
        for x, y in zip(first.hash_ids, other.hash_ids, strict=False):
            if x != y:
                break
            shared_ids += 1
        common = 0
        for x, y in zip(a, b, strict=False):
            if x != y:
                break
            common += 1
        if shared_ids < min(len(first.hash_ids), len(other.hash_ids)):
            # they part at an id: the engine blocks shared are those ids' whole blocks
            assert common == shared_ids * per_id
        else:
            # one's ids lead the other's: one prompt is the other's beginning
            assert common == min(len(a), len(b))


@given(requests(count=6), SCALES)
def test_the_ideal_work_is_an_unbounded_fake_cache(
    reqs: list[tw.TraceRequest], scale: tw.Scale
) -> None:
    cache = cost.PrefixCache(10**9)
    computed = 0
    for req in reqs:
        tokens = _tokens(req, scale)
        computed += len(tokens) - cache.lookup(tokens)
        cache.insert(tokens)
    work = tw.work(reqs, scale)
    assert work.ideal_computed == computed
    assert work.prompt_tokens == sum(scale.input_tokens(r) for r in reqs)
    assert work.working_set_blocks == len(cache.blocks)


def test_outputs_are_capped_then_scaled() -> None:
    req = tw.TraceRequest(0, 600, 2000, (1, 2))
    assert tw.Scale(1.0, 512).output_tokens(req) == 512
    assert tw.Scale(0.125, 512).output_tokens(req) == 64
    assert tw.Scale(0.125, 512).output_tokens(tw.TraceRequest(0, 1, 3, (1,))) == 1
    assert tw.Scale(0.125).input_tokens(req) == 64 + 11  # 88 trace tokens: 11 words


@pytest.mark.parametrize("factor", [0.1, 1 / 64, 0.0, -1.0])
def test_a_scale_must_keep_blocks_whole(factor: float) -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        tw.Scale(factor).check()


def test_a_trace_window_is_read_from_the_committed_slice() -> None:
    reqs = tw.load_trace(tw.NAMED["conversation"], 60, 30, 10_000)
    assert reqs
    assert all(0 <= r.at_ms < 30_000 for r in reqs)
    assert [r.at_ms for r in reqs] == sorted(r.at_ms for r in reqs)
    assert all(len(r.hash_ids) == -(-r.input_length // tw.TRACE_BLOCK) for r in reqs)
    assert len(tw.load_trace(tw.NAMED["synthetic"], 0, 600, 100)) == 100
