"""The built-in stand-in for a vLLM engine (``narwhal fake-engine``): the OpenAI endpoints
with NixlConnector's handoff, a KV side channel, and scripted faults. The demo fleet and
the test suites run on it; its wire behaviour follows the real captures in
``tests/captures/``."""

from narwhal.fake_engine.config import FakeEngineConfig
from narwhal.fake_engine.engine import FakeEngine

__all__ = ["FakeEngine", "FakeEngineConfig"]
