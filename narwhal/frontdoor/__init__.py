"""The front door: everything between the client's socket and an ASGI app (the router's).

``server`` serves the app it is handed, with its hooks, on our own serve loop over
hypercorn's public pieces (its ``Config``, its lifespan, its HTTP/1.1 protocol under
``connection.ClientConnection``) and a burst-accepting listener of our own (``listener``);
nothing in hypercorn or trio is replaced for the process. ``direct`` is the request's
direct write to its connection, which the app finds in ``scope["extensions"]`` (the ASGI
channel for server features). ``seams`` holds every private name of hypercorn and h11 the
front door touches, and ``internals_check`` checks them at start (``docs/upstream.md``
explains each).
"""
