"""`phoenixft serve`: the HTTP front and the engine processes behind it.

The front (``http`` app, ``handlers`` and ``shapes`` for OpenAI's endpoints, ``protocol``
bodies, ``errors``, ``limits``, ``metrics``; the request table ``remote`` and its
``store``) talks to engine processes (``engine_proc``) that ``supervisor`` starts, watches
and fails over, over ``wire`` carrying the typed ``messages``. ``front`` is the server
process (bind, start, announce, clean up), ``janitor`` cleans up after a killed one,
``cli`` holds the commands. Nothing is imported here.
"""
