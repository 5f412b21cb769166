"""Low-level I/O helpers: sockets, files and ZMQ, below the engines and the front door.

``fast_io`` reads and writes a socket without waiting, taking its number afresh at each
system call (compiled by mypyc: setup.py); ``line_writer`` is the one bounded-queue writer
thread the journal and the logs share; ``zmq_trio`` is pyzmq on trio's loop. The engine
transport (``narwhal.engines``), the front door (``narwhal.frontdoor``), the router and
``narwhal.observe`` build on them; they import nothing else of the package
(``tests/unit/test_architecture.py``).
"""
