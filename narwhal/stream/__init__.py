"""The pure stream code: SSE framing, chunked decoding, what an engine's event means, the
relay rules of a decode stream, and a non-streaming client's assembled answer.

Bytes or payloads in, actions out: no sockets, no clocks (``tests/unit/test_architecture.py``).
"""
