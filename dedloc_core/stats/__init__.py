"""The volunteer's own contribution and the swarm's progress, as data.

The code is organized as follows:

- ``db``: the local statistics (an SQLite file): per experiment and hour, samples, compute, rounds,
  bytes, paused time; versioned schema and migrations.
- ``recorder``: feeds ``db`` from a worker's events.
- ``cli``: ``dedloc stats``.
- ``swarmview``: the swarm's summary (``/swarm.json``): global step, samples/s, peers, learning
  curve, leaderboard.

A light room: the tray app's Statistics page reads it. Never torch or hivemind.
"""
