"""DeDLOC Volunteer engine: everything except the GUI. Imports no Qt.

The code is organized as follows:

- ``errors``: the exception tree; every error carries a title and a message for the user.
- ``paths``: per-user directories (platformdirs) and shipped resources (importlib.resources).
- ``catalog``: the signed experiment catalog (pydantic schema, Ed25519 signatures, loading).
- ``shards``: data shards (URL + sha256 + size), a bounded, verified download cache.
- ``httpserve``: a small HTTP server for the catalog and data shards (used by the backbone).
- ``recipes``: built-in model + data + loss + eval, chosen by name (``tiny-lm``, ``albert-mlm``).
- ``protocol``: the versioned JSON-lines protocol between the app and the worker.
- ``hivemind_patches``: our named fixes and hooks on hivemind 1.1.12.
- ``swarm``: building a hivemind DHT + Optimizer for an experiment.
- ``worker``: the worker process (``dedloc worker``).
- ``workerproc``: starting, talking to and stopping a worker process (no Qt).
- ``metrics``: signed per-peer metrics in the DHT (the leaderboard's source).
- ``backbone``: the organizer's headless node (``dedloc backbone``).
- ``swarmview``: the swarm summary as plain data (``/swarm.json``), no hivemind.
- ``statsdb``, ``statsrecorder``: the local contribution statistics (SQLite) and their feed from
  worker events; ``stats_cli``: ``dedloc stats``.
- ``idle``: seconds since the last user input, per desktop (X11, GNOME, KDE, logind, Windows, macOS).
- ``policy``, ``sampler``, ``contributor``: whether to contribute now and within which limits (a
  pure function), what the machine looks like, and the worker actions that follow.
- ``limits``, ``bandwidth``: limits the worker applies to itself (priority, threads, GPU, pause gate)
  and the shared token buckets that cap its p2p traffic.
- ``demo``: a backbone and volunteers on loopback (``dedloc demo``).
- ``cli``: the ``dedloc`` command.

Only ``worker``, ``swarm``, ``backbone``, ``hivemind_patches`` and recipe modules import torch or
hivemind, and only when they run.
"""

__version__ = "0.1.0"
