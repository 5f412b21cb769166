"""Admission decisions, pure: how many requests this process may hold at once.

``narwhal.router.admission.Admission`` is the shell that counts them and applies these.
"""

from __future__ import annotations


def inflight_share(max_inflight: int, index: int, count: int) -> int:
    """Worker ``index`` of ``count``'s share of ``serving.max_inflight``: the workers do
    not share a counter, so each admits its part, and the parts sum to ``max_inflight``
    (the first ``max_inflight % count`` workers take one more)."""
    return max_inflight // count + (1 if index < max_inflight % count else 0)
