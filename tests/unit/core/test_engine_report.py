"""An engine's /metrics read into a load report (contract 4.4): vLLM's names, garbage refused."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from narwhal.core.engine_report import EngineReport, ReportError, parse_report

# the shape vLLM 0.32 exports (v1/metrics/loggers.py), trimmed: two data-parallel ranks
VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 5.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 0.0
# HELP vllm:num_requests_waiting_by_reason Waiting requests by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 9.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.5
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 1000.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 250.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="tiny"} 0.0
"""


def test_vllm_exposition() -> None:
    report = parse_report(VLLM, at=5.0)
    assert (report.running, report.waiting, report.queued) == (4.0, 5.0, 9.0)
    assert report.kv_usage == 0.5  # the fullest rank
    assert report.prefix_hit_ratio == 0.25
    assert report.fresh(7.9, 1.0)
    assert not report.fresh(8.1, 1.0)
    assert not report.fresh(5.0, 0.0)  # scraping off: never fresh


def test_an_engine_without_prefix_counters() -> None:
    report = parse_report("vllm:num_requests_running 2\n", at=0.0)
    assert report == EngineReport(0.0, 2.0, 0.0, 0.0)
    assert report.prefix_hit_ratio is None


@pytest.mark.parametrize(
    "text",
    [
        "",
        "<html>not found</html>",
        "process_cpu_seconds_total 3\n",  # some other exporter
        "vllm:num_requests_running{engine=0} 1\n",  # unquoted label
        "vllm:num_requests_running one\n",
        "vllm:num_requests_waiting " + "9" * 400 + "\n",  # an integer no float holds
    ],
)
def test_what_is_not_an_engines_report_is_refused(text: str) -> None:
    with pytest.raises(ReportError):
        parse_report(text, at=0.0)


@given(st.text(max_size=400))
def test_garbage_is_a_report_or_a_report_error(text: str) -> None:
    try:
        report = parse_report("vllm:num_requests_waiting 1\n" + text, at=0.0)
    except ReportError:
        return
    assert math.isfinite(report.queued)  # a number, whatever the engine said
    assert 0.0 <= report.kv_usage <= 1.0


def test_a_count_is_a_float_in_either_build() -> None:
    """The exposition's "3" is the parser's int; the report says 3.0, compiled or not
    (``/narwhal/engines`` shows the same JSON under either build)."""
    report = parse_report("vllm:num_requests_waiting 3\nvllm:num_requests_running 2\n", at=0.0)
    assert (type(report.waiting), type(report.running)) == (float, float)


def test_the_kv_cache_size_comes_from_cache_config_info() -> None:
    text = (
        'vllm:num_requests_running{model_name="m"} 1\n'
        'vllm:cache_config_info{block_size="128",num_gpu_blocks="24",engine="0"} 1.0\n'
    )
    assert parse_report(text, at=0.0).kv_blocks == 24
    odd = text.replace('"24"', '"lots"')
    assert parse_report(odd, at=0.0).kv_blocks is None
