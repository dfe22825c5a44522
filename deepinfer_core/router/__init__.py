"""The P/D router (``deepinfer router``): prefill and decode engine processes behind one endpoint.

* ``balance``: the Prefill LB (uncached tokens in flight) and the Decode LB (running requests, then
  KV tokens held), with the max/mean load ratios they report.
* ``prefix``: the metadata-only prefix match against the shared KV store, done before routing.
* ``client``: a small HTTP/1.1 JSON client (the router has no other dependency than the server's).
* ``relay``: a decode engine's SSE stream relayed to the client, continued across drain-forwards.
* ``app``: the router's HTTP API (completions and chat, whole and streamed).
"""
