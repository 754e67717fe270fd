"""The engine: the worker process and everything that imports torch or hivemind.

The code is organized as follows:

- ``worker``: the worker process (``dedloc worker``): reads commands, runs training sessions.
- ``channel``: the worker's channels with the app (events out, commands in); light.
- ``training``: one training session (data, recipe, DHT, Optimizer, the loop, the watchdog).
- ``swarm``: building a hivemind DHT and Optimizer for an experiment.
- ``prefetch``: a newcomer's state download, begun in the DHT's event loop once the DHT is up
  (during the dial-back and while the Optimizer is built).
- ``parameter_rounds``: a step leaves a parameter round that found no group instead of waiting for it.
- ``pacing``: a sync-mode step long enough to hide a round (target batch, matchmaking time).
- ``diloco``, ``delta_averaging``, ``quant4``: low-communication training (DiLoCo), its delta
  all-reduce (with error feedback) and its 4-bit delta codec.
- ``hivemind_ext``: our named, guarded extensions of hivemind 1.1.12 (one module each, installed in order).
- ``load_balancing``: hivemind's all-reduce load balancing without scipy (registered here).
- ``no_dynamo``: torch.optim without importing torch._dynamo (a stand-in until something needs it).
- ``robust``: robust aggregation (NaN/inf parts dropped, centered clip) and bans of repeat offenders.
- ``bans``: the worker's ban list: shared by its averagers, kept across restarts, reported to the backbone.
- ``reducer_check``: the math of verified reduction (claims, sketches, the verdict on a reducer).
- ``gate``: invite-only swarms: the DHT authorizer, the token registry, who ``admits`` a peer.
- ``invited``: a volunteer's token for an invite-only experiment: redeem, renew at half life.
- ``bandwidth``: the shared token buckets that cap this peer's p2p traffic.
- ``reachability``: direct, via relay or outbound only; the dial-back service.
- ``progress_digest``: the backbone answers volunteers' reads of the swarm's progress in a few bytes a peer.
- ``dht_fallback``: a volunteer that only uses the swarm's DHT serves it while no backbone answers.
- ``metrics``: signed per-peer metrics in the DHT (the leaderboard's source).
- ``limits``: threads, GPU, bandwidth caps and the pause gate the worker applies to itself.
- ``priority``: the worker's lowest CPU and I/O priority, set before it imports torch.
- ``shard_cache``: the bounded, verified download cache of data shards.
- ``recipes``: the built-in models, data pipelines, losses and evaluations (and declared transformers models).
- ``keeper``: the backbone's engine half (follows the swarm's state, writes checkpoints).
- ``evaluation``: the backbone's loss on held-out data every few global steps (the curve's second line).
- ``member_relay``: the backbone's circuit relay in an invite-only experiment: for members only.
- ``selftest``: ``dedloc --self-test``, the installation check (drives a worker).

The engine may import anything light (the top-level modules, ``catalog``, ``policy``, ``stats``);
nothing light imports the engine, except the two entry points that start it inside the function
that runs it: ``dedloc_core.cli`` (``dedloc worker``, ``--self-test``) and
``dedloc_core.organizer.backbone`` (its ``keeper``). ``tests/test_layout.py`` holds that line.
Importing this package, ``worker`` or ``channel`` loads no torch: the worker says hello first.
"""

from dedloc_core.engine import load_balancing as _load_balancing

_load_balancing.register()  # before anything imports hivemind: keeps scipy out of the worker
