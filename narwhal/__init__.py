"""Narwhal: a router for disaggregated (prefill/decode) LLM serving in front of vLLM."""

__version__ = "0.8.0.dev0"
