"""DeDLOC Volunteer engine: everything except the GUI. Imports no Qt.

The code is organized in rooms, one package each, and a few shared light modules:

- ``engine/``: the worker process and everything that imports torch or hivemind (training, swarm,
  DiLoCo, hivemind patches, bandwidth caps, reachability, metrics, limits, the shard cache, recipes,
  the backbone's keeper, the self-test).
- ``organizer/``: the backbone node (``dedloc backbone``), its HTTP server, the demo, the invites
  of invite-only experiments (``dedloc invite``).
- ``catalog/``: the signed experiment catalog: model, recipe names and parameter schemas, the shard
  model, signing and verifying, the last good copy, its CLI and child process.
- ``policy/``: whether to contribute now (policy, sampler, contributor, hardware, idle sources).
- ``stats/``: the local contribution statistics, their recorder and CLI, the swarm's summary.
- shared light modules: ``errors`` (the exception tree), ``paths`` (user directories, shipped
  resources), ``protocol`` (app <-> worker messages), ``prefs`` (the user's preferences),
  ``secrets`` (the OS keyring), ``invites`` (invite tokens: format, checks, redeem client),
  ``joining`` (a ``start`` command from an experiment), ``schema`` (what the msgspec models share:
  reading validation errors, field metadata),
  ``autostart`` (start at login), ``workerproc`` (starting and stopping a worker, no Qt),
  ``backboneproc`` (the same for a backbone node), ``proctree`` (stopping a process with everything
  it started), ``environ`` (the ``DEDLOC_*`` environment variables), ``cli`` (the ``dedloc`` command),
  ``gpu_runtime`` and ``gpu_runtime_cli`` (a CUDA build of torch, installed on demand, and its command).

The line: only ``engine`` imports torch or hivemind. Everything else is light (the tray app may
import it) and never imports the engine, except ``cli`` and ``organizer.backbone``, which start it
inside the function that runs it. Within a room, imports are relative; across rooms, absolute.
``tests/test_layout.py`` checks the line and that no import cycle exists.
"""

__version__ = "0.1.0"
