"""The public Python surface of the NIXL connector (contract 7): ``PrefillResult`` as
``EngineClient.prefill`` returns it. The connector itself is pure and lives in
``narwhal.core.connector``; this name stays so callers' imports keep working."""

from narwhal.core.connector import PrefillResult

__all__ = ["PrefillResult"]
