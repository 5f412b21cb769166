"""The process shell: the ``narwhal`` binary and what runs a process around the router.

``cli`` parses the command line and ``commands`` runs the command asked for; ``startup``
holds what must hold before one starts, and ``config_files`` reads the fleet file from
disk. ``serve`` starts the router (``narwhal.router``) in this process or, under
``--workers N``, a parent (``workers``, ``kv_relay``) that starts a worker process per
listener, each running one (``worker_channel``, ``worker_process``); ``demo`` and ``check``
are the other commands, and ``build`` says which build (compiled or pure Python) runs. It
sits at the top of the package and may import any directory below it; nothing below
imports it but the router's reload, which reads the fleet file through ``config_files``
(``tests/unit/test_architecture.py``).
"""
