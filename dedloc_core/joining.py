"""What the app sends a worker to join an experiment: the ``Start`` command built from the catalog
entry, the preferences and where the swarm's files are. Plain Python, no Qt, no torch.

Overrides for organizers and tests (environment): ``DEDLOC_CATALOG_URL`` (where the signed catalog
is refreshed from; relative shard URLs resolve next to it), ``DEDLOC_INITIAL_PEERS`` (extra
bootstrap multiaddrs, space-separated), ``DEDLOC_TRUSTED_KEYS`` (a folder of extra ``*.pub`` keys),
``DEDLOC_LISTEN`` (the worker's listen multiaddrs, space-separated; default every interface, so
the backbone's dial-back can tell whether this peer is reachable).
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urljoin

import msgspec

from . import environ, paths
from .catalog import Experiment
from .prefs import Preferences
from .protocol import Limits, Start


def catalog_url() -> str | None:
    return environ.CATALOG_URL.optional()


def extra_peers() -> list[str]:
    return environ.INITIAL_PEERS.words()


def listen_maddrs() -> list[str]:
    return environ.LISTEN.words()


def trusted_key_paths() -> list[Path] | None:
    """Folders of trusted keys: the shipped ones plus ``DEDLOC_TRUSTED_KEYS``; None = shipped only."""
    extra = environ.TRUSTED_KEYS.optional()
    if not extra:
        return None
    from importlib import resources

    with resources.as_file(paths.resource("trusted_keys")) as shipped:
        return [Path(shipped), Path(extra)]


def progress_period() -> float:
    """Seconds between the worker's progress reports: 1, or ``DEDLOC_PROGRESS_PERIOD`` (benchmarks
    speed the events up with it; a value that is not a positive number is ignored)."""
    return environ.PROGRESS_PERIOD.number(0, 3600)


def swarm_summary_url(catalog: str | None) -> str | None:
    """The backbone's swarm summary, served next to the catalog the experiment came from."""
    return urljoin(catalog, "swarm.json") if catalog else None


def data_base_url(experiment: Experiment, catalog: str | None) -> str | None:
    """Where relative shard URLs resolve: the experiment's base, else next to the catalog."""
    if experiment.data.base_url:
        return None  # the worker uses the experiment's own base_url
    if catalog:
        return urljoin(catalog, ".")
    return None


def start_command(experiment: Experiment, prefs: Preferences, *, limits: Limits, data_url: str | None,
                  start_paused: bool = False) -> Start:
    """The ``start`` command for ``experiment``, with the limits the policy decided (policy.decide)."""
    peers = list(dict.fromkeys([*experiment.initial_peers, *extra_peers()]))
    return Start(
        experiment=msgspec.to_builtins(experiment),
        initial_peers=peers,
        host_maddrs=listen_maddrs(),
        data_base_url=data_url,
        identity_path=str(paths.data_dir() / "identity.key"),
        limits=limits,
        start_paused=start_paused,
        display_name=prefs.display_name,
        progress_period=progress_period(),
    )
