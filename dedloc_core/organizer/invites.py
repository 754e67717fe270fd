"""The organizer's invites for an invite-only experiment (``needs_token``): the backbone is the issuer.

``InviteStore`` keeps the invites and the peers that redeemed them in ``invites.db`` (SQLite, in the
backbone's run dir; codes stored as sha256 only). ``Issuer`` answers the backbone's HTTP endpoints:
``POST /invite/redeem`` (a code, once per peer) and ``POST /invite/renew`` (a member's new token),
both with a proof that the caller holds the libp2p identity the token is bound to; ``GET
/invite/info`` says the run id and token lifetime. ``POST /invite/report`` (signed the same way, from
members only, ``REPORTS_PER_HOUR`` each) records a peer that a member's worker banned, for
``dedloc invite reports``. The issuer's Ed25519 key is ``issuer.key`` in the
run dir, encrypted with ``$DEDLOC_INVITE_PASSPHRASE`` (never sent anywhere); the catalog entry's
``invite_key`` is its public half.

A code admits ``uses`` computers (default 1) until ``expires`` (default never); a redeemed peer stays a
member, renewing its token every half lifetime, until the organizer revokes its peer id or its code.
Revoking a peer also closes the code it redeemed (``closed``): the same volunteer cannot redeem it
again under a new identity, while the code's other members stay members. A revoked peer's renewal
is refused, and the backbone's keeper publishes the peers revoked within the last token lifetime as
a signed list in the DHT (``revoked_peers``, ``engine/gate.py``), so every peer refuses it within a
minute, whatever the token lifetime.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from dedloc_core import environ
from dedloc_core import invites as tokens
from dedloc_core.errors import DedlocError
from dedloc_core.invites import InviteError

DB_NAME = "invites.db"
KEY_NAME = "issuer.key"
PASSPHRASE_ENV = environ.INVITE_PASSPHRASE.name
DEFAULT_LIFETIME = 1800.0  # seconds a token is valid; a peer renews it at half
_ALPHABET = "ABCDEFGHJKMNPQRSTUVWXYZ23456789"  # no 0/O, 1/I/L
MAX_BODY = 16 * 1024

_SCHEMA = """
CREATE TABLE IF NOT EXISTS invites (id TEXT PRIMARY KEY, code_hash TEXT UNIQUE NOT NULL, created REAL NOT NULL,
    expires REAL, uses INTEGER NOT NULL, note TEXT NOT NULL DEFAULT '', revoked REAL, closed REAL);
CREATE TABLE IF NOT EXISTS members (peer_id TEXT PRIMARY KEY, invite_id TEXT NOT NULL, redeemed REAL NOT NULL,
    renewed REAL, revoked REAL);
"""


def normalize(code: str) -> str:
    return "".join(ch for ch in code.upper() if ch.isalnum())


def code_hash(code: str) -> str:
    return hashlib.sha256(("dedloc-invite/" + normalize(code)).encode()).hexdigest()


def parse_duration(text: str) -> float:
    """``7d``, ``12h``, ``30m``, ``45s`` or plain seconds, as seconds; ValueError otherwise."""
    text = text.strip().lower()
    units = {"d": 86400, "h": 3600, "m": 60, "s": 1}
    factor = units.get(text[-1:], None)
    number = float(text[:-1] if factor else text)
    if not number > 0 or number > 10 * 365 * 86400:
        raise ValueError(f"not a duration: {text!r}")
    return number * (factor or 1)


@dataclass(frozen=True)
class Invite:
    id: str
    created: float
    expires: float | None
    uses: int
    used: int
    note: str
    revoked: float | None
    members: tuple[str, ...]
    closed: float | None = None  # no new computers: one of its peers was revoked (its members stay)

    def state(self, now: float | None = None) -> str:
        now = time.time() if now is None else now
        if self.revoked:
            return "revoked"
        if self.closed:
            return "closed"
        if self.used >= self.uses:
            return "used up"
        if self.expires is not None and self.expires <= now:
            return "expired"
        return "open"


class InviteStore:
    """The invites of one backbone (SQLite; every change is one transaction)."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / DB_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        with self._db() as db:
            db.executescript(_SCHEMA)
            if "closed" not in {row[1] for row in db.execute("PRAGMA table_info(invites)")}:
                db.execute("ALTER TABLE invites ADD COLUMN closed REAL")  # an invites.db from before

    def _db(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, timeout=10, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        return db

    def _tx(self, fn):
        with self._lock:
            db = self._db()
            try:
                db.execute("BEGIN IMMEDIATE")
                result = fn(db)
                db.execute("COMMIT")
                return result
            except BaseException:
                db.execute("ROLLBACK")
                raise
            finally:
                db.close()

    def create(self, uses: int = 1, expires_in: float | None = None, note: str = "") -> tuple[str, str]:
        """A new invite: (code, invite id). The code is shown once; only its hash is kept."""
        if not 1 <= uses <= 1_000_000:
            raise DedlocError("--uses must be between 1 and 1000000.", title="Bad option", code="bad_option")
        raw = "".join(secrets.choice(_ALPHABET) for _ in range(16))
        code = "-".join(raw[i:i + 4] for i in range(0, 16, 4))
        invite_id = "inv-" + secrets.token_hex(4)
        now = time.time()
        self._tx(lambda db: db.execute(
            "INSERT INTO invites (id, code_hash, created, expires, uses, note) VALUES (?,?,?,?,?,?)",
            (invite_id, code_hash(code), now, now + expires_in if expires_in else None, uses, note)))
        return code, invite_id

    def list(self) -> list[Invite]:
        def read(db):
            rows = db.execute("SELECT id, created, expires, uses, note, revoked, closed FROM invites "
                              "ORDER BY created").fetchall()
            out = []
            for row in rows:
                members = tuple(m for (m,) in db.execute(
                    "SELECT peer_id FROM members WHERE invite_id=? ORDER BY redeemed", (row[0],)))
                out.append(Invite(row[0], row[1], row[2], row[3], len(members), row[4], row[5], members, row[6]))
            return out
        return self._tx(read)

    def members(self) -> list[tuple[str, str, float, float | None]]:
        """(peer id, invite id, redeemed, revoked) of every peer that redeemed a code."""
        return self._tx(lambda db: db.execute(
            "SELECT peer_id, invite_id, redeemed, revoked FROM members ORDER BY redeemed").fetchall())

    def revoke(self, target: str) -> str:
        """Revoke an invite (by code or id: its peers too) or one peer (by peer id: the code it redeemed
        is closed to new computers, its other members stay); say what was revoked."""
        now = time.time()

        def run(db):
            row = db.execute("SELECT id FROM invites WHERE code_hash=? OR id=?", (code_hash(target), target)).fetchone()
            if row:
                db.execute("UPDATE invites SET revoked=COALESCE(revoked, ?) WHERE id=?", (now, row[0]))
                n = db.execute("UPDATE members SET revoked=COALESCE(revoked, ?) WHERE invite_id=?", (now, row[0]))
                return f"Revoked invite {row[0]} and its {n.rowcount} peer(s)"
            member = db.execute("SELECT invite_id FROM members WHERE peer_id=?", (target,)).fetchone()
            if member:
                # the code it used, closed too: else the same volunteer redeems it again under a new identity
                db.execute("UPDATE members SET revoked=COALESCE(revoked, ?) WHERE peer_id=?", (now, target))
                db.execute("UPDATE invites SET closed=COALESCE(closed, ?) WHERE id=?", (now, member[0]))
                others = db.execute("SELECT COUNT(*) FROM members WHERE invite_id=? AND revoked IS NULL",
                                    (member[0],)).fetchone()[0]
                return (f"Revoked peer {target} and closed the code it used (invite {member[0]}) to new "
                        f"computers; its {others} other member(s) stay members (revoke them by peer id, or "
                        f"all with `dedloc invite revoke --run-dir DIR {member[0]}`)")
            raise DedlocError(f"No invite code, invite id or peer id {target!r} in {self.path}.",
                              title="Nothing to revoke", code="invite_unknown",
                              hint="`dedloc invite list --run-dir DIR` shows the invites and peers.")
        return self._tx(run)

    def redeem(self, code: str, peer_id: str, now: float | None = None) -> str:
        """Admit ``peer_id`` with ``code`` (again: no new use); the invite id, or InviteError."""
        now = time.time() if now is None else now

        def run(db):
            row = db.execute("SELECT id, expires, uses, revoked, closed FROM invites WHERE code_hash=?",
                             (code_hash(code),)).fetchone()
            if row is None:
                raise InviteError("invite_unknown", "The organizer's server does not know this invite code.")
            invite_id, expires, uses, revoked, closed = row
            member = db.execute("SELECT invite_id, revoked FROM members WHERE peer_id=?", (peer_id,)).fetchone()
            if revoked or (member and member[1]):
                raise InviteError("invite_revoked", "The organizer revoked this invite.")
            if member and member[0] == invite_id:
                return invite_id  # redeemed before by this very peer
            if closed:
                raise InviteError("invite_revoked", "The organizer revoked a computer that used this invite code, "
                                                    "which closed it to new computers.")
            if expires is not None and expires <= now:
                raise InviteError("invite_expired", "This invite code has expired.")
            used = db.execute("SELECT COUNT(*) FROM members WHERE invite_id=?", (invite_id,)).fetchone()[0]
            if used >= uses:
                raise InviteError("invite_used_up", f"This invite code was already used by {used} computer(s), "
                                                    "all it admits.")
            db.execute("INSERT OR REPLACE INTO members (peer_id, invite_id, redeemed) VALUES (?,?,?)",
                       (peer_id, invite_id, now))
            return invite_id
        return self._tx(run)

    def revoked_peers(self, since: float) -> list[tuple[str, float]]:
        """(peer id, revoked) of the members revoked at or after ``since``, oldest first: the peers
        whose tokens may still be valid (the revocation list the keeper publishes)."""
        return self._tx(lambda db: db.execute(
            "SELECT peer_id, revoked FROM members WHERE revoked >= ? ORDER BY revoked, peer_id", (since,)).fetchall())

    def check_member(self, peer_id: str) -> str:
        """The invite id of a member in good standing (for a renewal), or InviteError."""
        def run(db):
            row = db.execute("SELECT m.invite_id, m.revoked, i.revoked FROM members m JOIN invites i "
                             "ON i.id = m.invite_id WHERE m.peer_id=?", (peer_id,)).fetchone()
            if row is None:
                raise InviteError("invite_unknown", "This computer has not redeemed an invite for this experiment.")
            if row[1] or row[2]:
                raise InviteError("invite_revoked", "The organizer revoked this computer's invite.")
            db.execute("UPDATE members SET renewed=? WHERE peer_id=?", (time.time(), peer_id))
            return row[0]
        return self._tx(run)

    def add_report(self, reporter: str, reported: str, reason: str, now: float | None = None) -> int | None:
        """Record that member ``reporter`` banned ``reported``: the number of distinct members who
        reported it, None when ``reporter`` sent ``REPORTS_PER_HOUR`` already; InviteError unless
        ``reporter`` is a member in good standing."""
        now = time.time() if now is None else now

        def run(db):
            db.execute(_REPORTS_TABLE)
            row = db.execute("SELECT m.revoked, i.revoked FROM members m JOIN invites i ON i.id = m.invite_id "
                             "WHERE m.peer_id=?", (reporter,)).fetchone()
            if row is None:
                raise InviteError("invite_unknown", "Only members of this experiment may report peers.")
            if row[0] or row[1]:
                raise InviteError("invite_revoked", "The organizer revoked this computer's invite.")
            recent = db.execute("SELECT COUNT(*) FROM reports WHERE reporter=? AND time>?",
                                (reporter, now - 3600)).fetchone()[0]
            if recent >= REPORTS_PER_HOUR:
                return None
            db.execute("INSERT INTO reports (time, reporter, reported, reason) VALUES (?,?,?,?)",
                       (now, reporter, reported, reason))
            return db.execute("SELECT COUNT(DISTINCT reporter) FROM reports WHERE reported=?",
                              (reported,)).fetchone()[0]
        return self._tx(run)

    def reports(self) -> list[Report]:
        """Every member's report of a peer it banned, oldest first."""
        def run(db):
            db.execute(_REPORTS_TABLE)
            return [Report(*row) for row in db.execute(
                "SELECT time, reporter, reported, reason FROM reports ORDER BY time, id")]
        return self._tx(run)


REPORTS_PER_HOUR = 30  # reports a member may send in an hour: a worker bans a peer once per ban period
_REPORTS_TABLE = ("CREATE TABLE IF NOT EXISTS reports (id INTEGER PRIMARY KEY, time REAL NOT NULL, "
                  "reporter TEXT NOT NULL, reported TEXT NOT NULL, reason TEXT NOT NULL)")
_PEER_ID = re.compile(r"[1-9A-HJ-NP-Za-km-z]{20,64}")  # base58


@dataclass(frozen=True)
class Report:
    """A member's report that it banned a peer (``POST /invite/report``)."""

    time: float
    reporter: str
    reported: str
    reason: str


# --------------------------------------------------------------------------------- issuer key
def generate_key(run_dir: Path, passphrase: str) -> str:
    """Write a new encrypted ``issuer.key`` (refuses to overwrite one); return its public key text."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from dedloc_core import paths

    if not passphrase:
        raise InviteError("invite_unconfigured",
                          "A passphrase is required: the issuer key is never stored in plain text.")
    path = Path(run_dir) / KEY_NAME
    if path.exists():
        raise InviteError("invite_unconfigured", f"{path} exists already; remove it first to make a new key "
                                                 "(every token issued with it stops working).")
    key = Ed25519PrivateKey.generate()
    paths.atomic_write(path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.BestAvailableEncryption(passphrase.encode())))
    path.chmod(0o600)
    return tokens.public_key_text(key)


def load_key(run_dir: Path, passphrase: str | None):
    """The issuer's private key from ``issuer.key``; InviteError(invite_unconfigured) if it cannot be read."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    path = Path(run_dir) / KEY_NAME
    if not path.is_file():
        raise InviteError("invite_unconfigured", f"No issuer key at {path}: run `dedloc invite keygen --run-dir "
                                                 f"{run_dir}` and put its public key in the catalog's invite_key.")
    if not passphrase:
        raise InviteError("invite_unconfigured", f"No passphrase for {path}: set ${PASSPHRASE_ENV}.")
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), passphrase.encode())
    except (ValueError, TypeError) as exc:
        raise InviteError("invite_unconfigured", f"Cannot read {path} (wrong passphrase?): {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise InviteError("invite_unconfigured", f"{path} is not an Ed25519 key.")
    return key


# ------------------------------------------------------------------------------------- issuer
_STATUS = {"invite_unknown": 404, "invite_expired": 410, "invite_revoked": 403, "invite_used_up": 409,
           "token_invalid": 400}


class Issuer:
    """Issues tokens for ``run_id``: the backbone's ``/invite/*`` endpoints and its own token."""

    def __init__(self, store: InviteStore, private_key, run_id: str, lifetime: float = DEFAULT_LIFETIME):
        self.store, self.key, self.run_id, self.lifetime = store, private_key, run_id, lifetime
        self.public_key_text = tokens.public_key_text(private_key)

    def token_for(self, peer_id: str, invite_id: str) -> str:
        now = time.time()
        return tokens.issue(self.key, tokens.Claims(self.run_id, peer_id, now, now + self.lifetime, invite_id))

    def info(self) -> bytes:
        return json.dumps({"run_id": self.run_id, "invite_key": self.public_key_text,
                           "lifetime": self.lifetime}).encode()

    def _proven_peer(self, action: str, request: dict, extra: str = "") -> str:
        try:
            der = bytes.fromhex(request["public_key"])
            when = float(request["time"])
            signature = bytes.fromhex(request["signature"])
            peer_id = str(request["peer_id"])
        except (KeyError, ValueError, TypeError):
            raise InviteError("token_invalid", "A malformed request.") from None
        if not abs(time.time() - when) <= tokens.PROOF_WINDOW:  # NaN too: a proof that never ages
            raise InviteError("token_invalid", "The request is too old (or this computer's clock is wrong).")
        signer = tokens.check_proof(der, tokens.proof_message(action, self.run_id, peer_id, when, extra), signature)
        if signer is None or signer != peer_id:
            raise InviteError("token_invalid", "The request is not signed by the peer it names.")
        return peer_id

    ACTIONS = ("redeem", "renew", "report")

    def add_routes(self, server) -> None:
        """The backbone's ``/invite/*`` endpoints on ``server`` (an ``httpserve.FileServer``): ``info``,
        then one POST route per action (``report``: peers a member banned)."""
        server.add("/invite/info", self.info)
        for action in self.ACTIONS:
            server.add_post(f"/invite/{action}", functools.partial(self.handle, action))

    def handle(self, action: str, body: bytes) -> tuple[int, bytes]:
        """Answer ``POST /invite/<action>`` (redeem, renew or report): (HTTP status, JSON body)."""
        try:
            if len(body) > MAX_BODY:
                raise InviteError("token_invalid", "The request is too large.")
            try:
                request = json.loads(body)
                if not isinstance(request, dict):
                    raise ValueError
            except (ValueError, RecursionError):  # RecursionError: nested too deeply for json's parser
                raise InviteError("token_invalid", "A malformed request.") from None
            if action == "redeem":
                code = request.get("code")
                if not isinstance(code, str) or not 1 <= len(code) <= 200:
                    raise InviteError("invite_unknown", "No invite code in the request.")
                peer_id = self._proven_peer("redeem", request, normalize(code))
                invite_id = self.store.redeem(code, peer_id)
            elif action == "renew":
                peer_id = self._proven_peer("renew", request)
                invite_id = self.store.check_member(peer_id)
            elif action == "report":
                return self._report(request)
            else:
                return 404, b'{"error": "not_found"}'
        except InviteError as exc:
            return _STATUS.get(exc.code, 400), json.dumps({"error": exc.code, "message": exc.message}).encode()
        token = self.token_for(peer_id, invite_id)
        return 200, json.dumps({"token": token, "expires": time.time() + self.lifetime}).encode()

    def _report(self, request: dict) -> tuple[int, bytes]:
        """A member's report of a peer it banned, signed like a renewal: recorded for the organizer
        (``dedloc invite reports``), who decides whether to revoke that peer."""
        reported, reason = request.get("reported"), request.get("reason")
        if not isinstance(reported, str) or not _PEER_ID.fullmatch(reported) or not isinstance(reason, str) \
                or len(reason) > 200:
            raise InviteError("token_invalid", "A malformed report.")
        reporter = self._proven_peer("report", request, f"{reported}\n{reason}")
        if reporter == reported:
            raise InviteError("token_invalid", "A peer cannot report itself.")
        reporters = self.store.add_report(reporter, reported, reason)
        if reporters is None:
            return 429, json.dumps({"error": "rate_limited", "message": f"At most {REPORTS_PER_HOUR} reports an "
                                    "hour from one computer."}).encode()
        return 200, json.dumps({"recorded": True, "reporters": reporters}).encode()
