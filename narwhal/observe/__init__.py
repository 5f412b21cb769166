"""Observability: what the router tells its operators.

``metrics`` is the router's Prometheus series and label sets (``metric_series`` each
series, ``metrics_exposition`` the ``/metrics`` text, ``batched_histogram`` the histograms
a request's token gaps are added to once); ``logs`` is the text and JSON logs and
``tracing`` the OpenTelemetry spans. The router, the engines and the process shell
(``narwhal.process``) report through it; it reads the core's types and writes through
``narwhal.lowlevel``'s line writer, and imports nothing of the router, the engines, the
front door or the shell (``tests/unit/test_architecture.py``).
"""
