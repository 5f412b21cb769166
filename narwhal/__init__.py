"""Narwhal: a router for disaggregated (prefill/decode) LLM serving in front of vLLM."""

__version__ = "0.8.0.dev0"

from narwhal.process import build as _build  # stdlib only: loads before any compiled module

if _build.pure_requested():  # the pure-Python build of a compiled tree
    _build.prefer_sources()
