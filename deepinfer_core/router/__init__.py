"""The P/D router (``deepinfer router``): prefill and decode engine processes behind one endpoint.

* ``balance``: the Prefill LB (uncached tokens in flight) and the Decode LB (running requests, then
  KV tokens held), with the max/mean load ratios they report.
* ``prefix``: the metadata-only prefix match against the shared KV store, done before routing.
* ``client``: a small HTTP/1.1 JSON client (the router has no other dependency than the server's).
* ``relay``: decode engines' SSE streams relayed to the client, continued across drain-forwards.
* ``decode``: each prompt's decode leg (all its ``n`` / ``best_of`` samples), whole or streamed, and
  the completions a draining decode engine forwarded, continued one by one on another engine.
* ``app``: the router's HTTP API (completions and chat, whole and streamed, ``n``, ``best_of``, prompt
  lists), the request checks, and the prefill legs.
"""
