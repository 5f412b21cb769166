"""The front door: everything between the client's socket and the router's ASGI app.

``server`` serves the app with our own serve loop on hypercorn's public pieces (its
``Config``, its lifespan, its ``TCPServer`` subclassed as ``connection.ClientConnection``)
over a burst-accepting listener of our own (``listener``); nothing in hypercorn or trio is
replaced for the process. ``direct`` is the request's direct write to its connection,
which the app finds in ``scope["extensions"]`` (the ASGI channel for server features).
``shapes`` checks, at start, the hypercorn and h11 internals that ``connection`` and
``direct`` subclass or copy (``docs/upstream.md`` explains each entry).
"""
