"""The ``DEDLOC_*`` environment variables: each declared once here (name, default, what it does) and
read only through the accessors of its ``Variable``. For organizers, tests and benchmarks; a
volunteer sets none. Light (``os`` only): the app imports it. ``VARIABLES`` lists them all.

Child processes inherit them; to set one for a child, use its name (``{HOME.name: folder}``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Variable:
    name: str
    default: str  # what an unset variable reads as ("": nothing)
    help: str

    def text(self) -> str:
        """The value, or the default when unset (set but empty reads as empty)."""
        return os.environ.get(self.name, self.default)

    def optional(self) -> str | None:
        """The value, or None when unset or empty."""
        return os.environ.get(self.name) or None

    def words(self) -> list[str]:
        """The value split on whitespace; the default's words when that leaves none."""
        return self.text().split() or self.default.split()

    def flag(self) -> bool:
        """Whether the value is "1"."""
        return self.text() == "1"

    def integer(self) -> int:
        """The value as an integer; the default if it is not one."""
        try:
            return int(self.text())
        except ValueError:
            logger.warning("%s=%r is not an integer: using %s", self.name, self.text(), self.default)
            return int(self.default)

    def number(self, low: float, high: float) -> float:
        """The value as a number in (``low``, ``high``]; the default if it is not one."""
        try:
            value = float(self.text())
        except ValueError:
            return float(self.default)
        return value if low < value <= high else float(self.default)


HOME = Variable(
    "DEDLOC_HOME", "",
    "A folder that replaces the user's data, config, cache and log folders (tests, benchmarks, the demo's "
    "peers); the app's single-instance lock is then one per folder.")
LOG_LEVEL = Variable("DEDLOC_LOG_LEVEL", "INFO", "Log level of the worker and the backbone (e.g. DEBUG).")
CATALOG_URL = Variable(
    "DEDLOC_CATALOG_URL", "",
    "Where the signed catalog is refreshed from, in place of the built-in source; relative shard URLs "
    "resolve next to it.")
TRUSTED_KEYS = Variable("DEDLOC_TRUSTED_KEYS", "", "A folder of extra trusted catalog keys (*.pub).")
INITIAL_PEERS = Variable("DEDLOC_INITIAL_PEERS", "", "Extra bootstrap multiaddrs for the worker, space-separated.")
LISTEN = Variable(
    "DEDLOC_LISTEN", "/ip4/0.0.0.0/tcp/0",
    "The worker's listen multiaddrs, space-separated (every interface by default, so that the backbone's "
    "dial-back can tell whether this peer is reachable).")
PROGRESS_PERIOD = Variable(
    "DEDLOC_PROGRESS_PERIOD", "1",
    "Seconds between the worker's progress reports (0 < s <= 3600; benchmarks speed them up).")
WORKER_NICE = Variable("DEDLOC_WORKER_NICE", "19", "The worker's nice value (tests on a shared machine).")
CACHE_BYTES = Variable("DEDLOC_CACHE_BYTES", str(2 * 2**30), "The size of the worker's shard cache, in bytes.")
IDLE_LOOP = Variable(
    "DEDLOC_IDLE_LOOP", "1",
    "1: the worker's training loop runs below its hivemind helpers (SCHED_IDLE); 0: at the same priority.")
HELPER_THREADS = Variable(
    "DEDLOC_HELPER_THREADS", "none",
    "Run hivemind's DHT (dht) or the DHT and the averagers (all) as threads of the worker instead of "
    "processes; none: processes.")
SOCKET_DIR = Variable(
    "DEDLOC_SOCKET_DIR", "",
    "The folder for hivemind's unix sockets; WorkerProcess sets one per worker and removes it with the worker.")
CATALOG_PASSPHRASE = Variable(
    "DEDLOC_CATALOG_PASSPHRASE", "", "The catalog signing key's passphrase (dedloc catalog); asked for if unset.")
INVITE_PASSPHRASE = Variable(
    "DEDLOC_INVITE_PASSPHRASE", "",
    "The invite issuer key's passphrase: dedloc invite asks for it if unset; the backbone of an "
    "invite-only experiment needs it.")

VARIABLES = (HOME, LOG_LEVEL, CATALOG_URL, TRUSTED_KEYS, INITIAL_PEERS, LISTEN, PROGRESS_PERIOD, WORKER_NICE,
             CACHE_BYTES, IDLE_LOOP, HELPER_THREADS, SOCKET_DIR, CATALOG_PASSPHRASE, INVITE_PASSPHRASE)
