"""The organizer's backbone node (``dedloc backbone``): headless, no GPU needed.

It bootstraps the DHT with a stable identity and given listen/announce addresses, relays for peers
behind NAT (p2pd's relay service; in an invite-only experiment ``engine/member_relay.py``, for
members only), keeps the latest training state (it loads the swarm's state after
each global step, serves it to newcomers and writes a checkpoint atomically every N steps), records
the learning curve and per-peer contributions that peers publish in the DHT, and serves the signed
catalog and the data shards over HTTPS (``--tls-cert``, ``--tls-key``; plain HTTP only on loopback or
with ``--insecure-http``). On restart it resumes from its last checkpoint.

Files in ``--run-dir``: ``identity.key``, ``checkpoint.pt``, ``learning_curve.jsonl`` (a JSON object a
line: the swarm's ``time, step, num_peers, samples_per_second, loss``, and the backbone's evaluations
``time, step, eval_loss``), ``contributions.csv`` and ``ready.json`` (addresses, once the node is up). ``/swarm.json``
serves the swarm's summary (global step, samples/s, peers, learning curve, leaderboard; see
``dedloc_core.stats.swarmview``); ``/`` the public dashboard (``organizer.dashboard``) and ``/catalog.pub``
the public key line of the key that signed the served catalog.

This module is light (the command line, the HTTP side, the records); the training state is kept by
``dedloc_core.engine.keeper``, imported once the HTTP side is up.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import sys
import threading
import time
from contextlib import ExitStack
from importlib import resources
from pathlib import Path

from dedloc_core import environ, paths
from dedloc_core.catalog import load_trusted_keys, public_key_line, verify_catalog
from dedloc_core.errors import DedlocError, report, user_message
from dedloc_core.invites import InviteError, is_loopback, verify
from dedloc_core.stats.swarmview import SwarmView

from . import dashboard, invites
from .httpserve import FileServer, bearer_token

logger = logging.getLogger(__name__)



def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dedloc backbone", description=__doc__.splitlines()[0])
    p.add_argument("--experiment", default="tiny-lm-demo", help="experiment id in the catalog")
    p.add_argument("--catalog", type=Path, help="signed catalog to publish (default: the shipped one)")
    p.add_argument("--trusted-key", type=Path, action="append", default=[], help="extra trusted public key")
    p.add_argument("--run-dir", type=Path, default=None, help="state directory (default: user data dir)")
    p.add_argument("--listen", action="append", default=[], help="listen multiaddr (repeatable)")
    p.add_argument("--announce", action="append", default=[], help="announced multiaddr (repeatable)")
    p.add_argument("--initial-peer", action="append", default=[], help="other backbones to join")
    p.add_argument("--http-host", default="127.0.0.1",
                   help="address the HTTP(S) server listens on; other than loopback it needs --tls-cert and "
                        "--tls-key, or --insecure-http")
    p.add_argument("--http-port", type=int, default=0, help="0 picks a free port; -1 disables HTTP")
    p.add_argument("--tls-cert", type=Path, default=None, metavar="PEM",
                   help="serve HTTPS with this certificate (chain), for the name volunteers use in the catalog's URLs")
    p.add_argument("--tls-key", type=Path, default=None, metavar="PEM", help="the private key of --tls-cert")
    p.add_argument("--insecure-http", action="store_true",
                   help="serve plain HTTP on a non-loopback address: invite codes, access tokens, the catalog "
                        "and the data travel unencrypted, anyone on the way can read or change them")
    p.add_argument("--data-dir", type=Path, default=None, help="served at /data/ (default: the shipped corpus)")
    p.add_argument("--checkpoint-every", type=int, default=5, help="global steps between checkpoints")
    p.add_argument("--eval-every", type=int, default=5,
                   help="global steps between evaluations of the model on the held-out data (0: never)")
    p.add_argument("--eval-batches", type=int, default=4, help="batches of 16 sequences per evaluation")
    p.add_argument("--poll", type=float, default=1.0, help="seconds between checks of the swarm")
    p.add_argument("--follow-every", type=float, default=30.0,
                   help="sync mode: at least this many seconds between loads of the swarm's state "
                        "(each is the whole state, uploaded by a volunteer)")
    p.add_argument("--ready-file", type=Path, default=None)
    p.add_argument("--no-relay", action="store_true",
                   help="do not relay for volunteers behind NAT (they join outbound only)")
    p.add_argument("--contact", default="", metavar="TEXT",
                   help="how volunteers ask for an invite; shown on the dashboard for invite-only experiments")
    p.add_argument("--token-lifetime", type=float, default=None, metavar="SECONDS",
                   help="invite-only experiments: how long an issued token is valid (default 1800; renewed at half)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=environ.LOG_LEVEL.text(),
        format="%(asctime)s %(levelname)s [backbone] %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return Backbone(args).run()
    except DedlocError as exc:
        logger.error("%s", user_message(exc).line())
        return report(exc)


class Backbone:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.run_dir = args.run_dir or (paths.data_dir() / "backbone" / args.experiment)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.stop = threading.Event()
        self.issuer: invites.Issuer | None = None  # set by run() for an invite-only experiment

    def _load_catalog(self) -> tuple[bytes, object, str]:
        """The signed catalog's bytes, our experiment, and the public key line that signed it."""
        keys = load_trusted_keys()
        keys.update(load_trusted_keys(self.args.trusted_key) if self.args.trusted_key else {})
        if self.args.catalog:
            data = self.args.catalog.read_bytes()
        else:
            data = paths.resource("catalog", "default.json").read_bytes()
        catalog = verify_catalog(data, keys)
        experiment = catalog.get(self.args.experiment)
        if experiment is None:
            raise DedlocError(f"No experiment {self.args.experiment!r} in the catalog.", title="Unknown experiment")
        key_line = public_key_line(keys[json.loads(data)["key_id"]])  # verified above: the key is there
        return data, experiment, key_line

    def run(self) -> int:
        catalog_bytes, exp, key_line = self._load_catalog()
        self.issuer = self._issuer(exp) if exp.needs_token else None
        self.view = SwarmView.load(self.run_dir, exp.run_id)
        with ExitStack() as stack:
            http_url = None
            if self.args.http_port >= 0:
                http_url = self._serve_http(stack, catalog_bytes, exp, key_line)
            self._train_keeper(exp, http_url)
        return 0

    def _serve_http(self, stack: ExitStack, catalog_bytes: bytes, exp, key_line: str) -> str:
        """Serve the catalog, the dashboard, ``/swarm.json``, the data and (invite-only) ``/invite/*``.

        Invite-only: strangers get the public swarm summary (no peer ids: with them, a stranger found
        every member's address through the DHT) and a 401 for the data unless the catalog says
        ``data.public``; a request with a member's token (``Authorization: Bearer``) gets both."""
        cert, key = self._tls_files()
        server = FileServer({"/catalog.json": catalog_bytes, "/catalog.pub": (key_line + "\n").encode()},
                            host=self.args.http_host, port=self.args.http_port, tls_cert=cert, tls_key=key)
        member = self._member_check(exp)
        server.add_view("/swarm.json", lambda headers: self.view.to_json(public=not member(headers)))
        page = dashboard.render(exp, key_line, self.args.contact)
        server.add("/", page, content_type="text/html; charset=utf-8")
        server.add("/index.html", page)
        data_dir = self.args.data_dir
        if data_dir is None:
            data_dir = stack.enter_context(resources.as_file(paths.resource("corpus")))
        server.serve_dir("/data/", Path(data_dir))
        if self.issuer is not None and not exp.data.public:
            server.guard("/data/", member, "this experiment's data is for its members; send your access token")
        if self.issuer is not None:  # invite-only: redeem codes, renew tokens (organizer/invites.py)
            self.issuer.add_routes(server)
        try:
            stack.enter_context(server)
        except OSError as exc:  # the port is taken, or the certificate or key is unusable (ssl.SSLError)
            raise DedlocError(f"Cannot serve on {self.args.http_host}:{self.args.http_port}: {exc}",
                              title="Backbone not started", code="http_failed") from exc
        logger.info("Serving the catalog and data at %s", server.url)
        logger.info("Dashboard at %s", server.url)
        return server.url

    def _tls_files(self) -> tuple[Path | None, Path | None]:
        """The certificate and key to serve HTTPS with; (None, None) for plain HTTP, which is only
        allowed on loopback or with ``--insecure-http``."""
        cert, key = self.args.tls_cert, self.args.tls_key
        if (cert is None) != (key is None):
            raise DedlocError("HTTPS needs both --tls-cert and --tls-key.", title="Backbone not started",
                              code="tls_incomplete")
        for path in (cert, key):
            if path is not None and not path.is_file():
                raise DedlocError(f"No such file: {path}.", title="Backbone not started", code="tls_incomplete")
        if cert is None and not self.args.insecure_http and not is_loopback(self.args.http_host):
            raise DedlocError(
                f"The backbone would serve plain HTTP on {self.args.http_host}: invite codes, access tokens and "
                "the data would travel unencrypted.", title="HTTPS needed", code="tls_needed",
                hint="Pass --tls-cert and --tls-key (a certificate for the name in the catalog's URLs), or "
                     "--insecure-http to accept plain HTTP, or listen on 127.0.0.1 behind a TLS proxy.")
        return cert, key

    def _member_check(self, exp):
        """``check(headers)``: does the request carry a valid token for this run, of a member not
        revoked since the token was issued? Always true for an open experiment (no issuer): everything
        it serves is public."""
        if self.issuer is None:
            return lambda headers: True
        public_key = self.issuer.key.public_key()

        def check(headers) -> bool:
            token = bearer_token(headers)
            if token is None:
                return False
            try:
                claims = verify(token, public_key, exp.run_id)
            except InviteError:
                return False
            # a revoked member's token stays valid until it expires; its backbone knows at once
            return claims.peer_id not in dict(self.issuer.store.revoked_peers(since=claims.issued))

        return check

    def _issuer(self, exp) -> invites.Issuer:
        """The token issuer of an invite-only experiment; its key must be the catalog's ``invite_key``."""
        if not exp.invite_key:
            raise InviteError("invite_unconfigured", f"{exp.id} is invite-only (needs_token) but its catalog entry "
                                                     "has no invite_key: see `dedloc invite keygen`.")
        key = invites.load_key(self.run_dir, environ.INVITE_PASSPHRASE.optional())
        lifetime = self.args.token_lifetime or invites.DEFAULT_LIFETIME
        issuer = invites.Issuer(invites.InviteStore(self.run_dir), key, exp.run_id, lifetime)
        if issuer.public_key_text != exp.invite_key:
            raise InviteError("invite_unconfigured", f"{self.run_dir / invites.KEY_NAME} is not the key named by "
                                                     f"the catalog's invite_key for {exp.id}.")
        return issuer

    def _train_keeper(self, exp, http_url: str | None) -> None:
        from dedloc_core.engine import keeper  # torch and hivemind: only now, once the HTTP side is up

        keeper.keep(exp, self.args, self.run_dir, http_url, stop=self.stop,
                    recorder=Recorder(self.run_dir, self.view), write_ready=self._write_ready, issuer=self.issuer)

    def _write_ready(self, info: dict) -> None:
        path = self.args.ready_file or (self.run_dir / "ready.json")
        paths.atomic_write(path, json.dumps(info).encode())


class Recorder:
    """Appends the learning curve (JSON lines) and per-peer contributions (CSV)."""

    FIELDS = ["time", "peer_id", "display_name", "step", "samples", "compute_seconds", "loss"]

    def __init__(self, run_dir: Path, view=None):
        self.view = view  # a swarmview.SwarmView served at /swarm.json, or None
        self.curve = run_dir / "learning_curve.jsonl"
        self.contrib = run_dir / "contributions.csv"
        self.last_step = -1
        self.seen: dict[str, tuple[int, int]] = {}

    def record_eval(self, step: int, loss: float) -> None:
        """The backbone's own evaluation of the swarm's model at ``step`` on the held-out data."""
        entry = {"time": time.time(), "step": step, "eval_loss": round(loss, 5)}
        with self.curve.open("a") as f:
            f.write(json.dumps(entry) + "\n")
        if self.view is not None:
            self.view.add_point(entry)

    def record(self, step: int, num_peers: int, peers) -> None:
        now = time.time()
        if step != self.last_step:
            losses = [p.loss for p in peers if p.loss is not None]
            entry = {"time": now, "step": step, "num_peers": num_peers,
                     "samples_per_second": round(sum(p.samples_per_second for p in peers), 3),
                     "loss": round(sum(losses) / len(losses), 5) if losses else None}
            with self.curve.open("a") as f:
                f.write(json.dumps(entry) + "\n")
            self.last_step = step
            if self.view is not None:
                self.view.add_point(entry)
        if self.view is not None:
            self.view.set_status(step, sum(p.samples_per_second for p in peers), num_peers)
            for p in peers:
                self.view.add_record(p.peer_id, p.display_name, p.samples, p.compute_seconds, p.time)
        fresh = [p for p in peers if self.seen.get(p.peer_id) != (p.step, p.samples)]
        if not fresh:
            return
        new_file = not self.contrib.exists()
        with self.contrib.open("a", newline="") as f:
            writer = csv.writer(f)
            if new_file:
                writer.writerow(self.FIELDS)
            for p in fresh:
                writer.writerow([round(now, 3), p.peer_id, p.display_name, p.step, p.samples,
                                 round(p.compute_seconds, 3), p.loss])
                self.seen[p.peer_id] = (p.step, p.samples)


if __name__ == "__main__":
    sys.exit(main())
