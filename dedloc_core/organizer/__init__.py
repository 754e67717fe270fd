"""The organizer's side: the backbone node, its HTTP server, and the demo.

The code is organized as follows:

- ``backbone``: ``dedloc backbone``, the headless node (DHT bootstrap, relay, catalog and data over
  HTTPS, ``/swarm.json``, the learning curve and contributions); its training state is kept by
  ``dedloc_core.engine.keeper``, imported only when the node runs.
- ``dashboard``: the backbone's public page at ``/`` (one self-contained HTML page polling
  ``swarm.json``: learning curve, leaderboard, the ``dedloc://add`` link for volunteers).
- ``httpserve``: a small static HTTP(S) server on uvicorn (files, bytes, callables, ranges, and POST
  endpoints with size and rate limits); uvicorn is imported when a server starts.
- ``invites``: the invites of an invite-only experiment (SQLite store, hashed codes) and the
  issuer of tokens behind the backbone's ``/invite/redeem`` and ``/invite/renew``.
- ``invite_cli``: ``dedloc invite keygen|create|list|revoke|redeem``.
- ``demo``: ``dedloc demo``, a backbone and volunteer workers on loopback (or an organizer's own catalog).
- ``dataprep``: ``dedloc data prepare``: a folder of text to a tokenizer, token shards and a catalog entry.

Light at import: the standard library and the light rooms.
"""
