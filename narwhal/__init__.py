"""Narwhal: a router for disaggregated (prefill/decode) LLM serving in front of vLLM."""

__version__ = "0.8.0.dev0"

import os as _os

if _os.environ.get("NARWHAL_PURE") == "1":  # the pure-Python build of a compiled tree
    from narwhal.build import prefer_sources

    prefer_sources()
