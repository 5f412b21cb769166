"""The pure core: decisions, parsers and state tables (sans-IO).

Nothing here opens a socket, reads a clock on its own or imports trio, hypercorn, h11 or
httpcore; the shells (``narwhal.router``, ``narwhal.engines``, ``narwhal.frontdoor``) call
in with what they observed and act on what comes back. ``tests/unit/test_architecture.py``
holds the rule.
"""
