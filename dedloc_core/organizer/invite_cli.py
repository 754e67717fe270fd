"""``dedloc invite``: the organizer's invites (keygen, create, list, revoke, reports) and a volunteer's redeem.

The organizer's commands work on the backbone's run dir (``invites.db``, ``issuer.key``); the key's
passphrase comes from ``$DEDLOC_INVITE_PASSPHRASE`` or the terminal. ``redeem`` checks a code against
a backbone (and, with ``--experiment``, keeps code and token in the keyring as the app does).
"""

from __future__ import annotations

import argparse
import getpass
import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from dedloc_core import environ
from dedloc_core.errors import DedlocError, report
from dedloc_core.invites import InviteError

from . import invites


def _when(ts: float | None) -> str:
    return "never" if ts is None else datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M UTC")


def _passphrase() -> str:
    env = environ.INVITE_PASSPHRASE.optional()
    if env:
        return env
    try:
        first = getpass.getpass("Issuer key passphrase: ")
        if getpass.getpass("Repeat the passphrase: ") != first:
            raise InviteError("invite_unconfigured", "The passphrases differ.")
    except EOFError:
        raise InviteError("invite_unconfigured",
                          f"No passphrase: set ${invites.PASSPHRASE_ENV} or run in a terminal.") from None
    return first


def _keygen(args: argparse.Namespace) -> int:
    key = invites.generate_key(args.run_dir, _passphrase())
    print(f"Wrote {args.run_dir / invites.KEY_NAME} (encrypted).")
    print("Put this in the experiment's catalog entry, with needs_token: true and invite_url: the backbone's URL:")
    print(f'  "invite_key": "{key}"')
    return 0


def _create(args: argparse.Namespace) -> int:
    try:
        expires = invites.parse_duration(args.expires) if args.expires else None
    except ValueError:
        raise DedlocError(f"--expires {args.expires!r} is not a duration like 7d, 12h or 30m.",
                          title="Bad option", code="bad_option") from None
    code, invite_id = invites.InviteStore(args.run_dir).create(args.uses, expires, args.note)
    print(code)
    print(f"(invite {invite_id}: {args.uses} use(s), expires {_when(time.time() + expires if expires else None)}; "
          "the code is shown only now)", file=sys.stderr)
    return 0


def _list(args: argparse.Namespace) -> int:
    store = invites.InviteStore(args.run_dir)
    rows, members = store.list(), store.members()
    if args.json:
        print(json.dumps({"invites": [{"id": i.id, "state": i.state(), "uses": i.uses, "used": i.used, "note": i.note,
                                       "created": i.created, "expires": i.expires, "closed": i.closed,
                                       "peers": list(i.members)}
                                      for i in rows],
                          "peers": [{"peer_id": p, "invite": inv, "redeemed": r, "revoked": rv}
                                    for p, inv, r, rv in members]}, indent=2))
        return 0
    if not rows:
        print("No invites yet: dedloc invite create --run-dir DIR")
        return 0
    print(f"{'INVITE':<13} {'STATE':<8} {'USED':>9} {'EXPIRES':<21} NOTE")
    for i in rows:
        print(f"{i.id:<13} {i.state():<8} {f'{i.used}/{i.uses}':>9} {_when(i.expires):<21} {i.note}")
    if members:
        print(f"\n{'PEER':<54} {'INVITE':<13} STATE")
        for peer, inv, _, revoked in members:
            print(f"{peer:<54} {inv:<13} {'revoked' if revoked else 'member'}")
    return 0


def _revoke(args: argparse.Namespace) -> int:
    print(invites.InviteStore(args.run_dir).revoke(args.target) + ".\nThe running backbone lists the revoked "
          "peer(s) in its signed revocation list: every member refuses them within a minute.")
    return 0


def _reports(args: argparse.Namespace) -> int:
    store = invites.InviteStore(args.run_dir)
    reports = store.reports()
    standing = {peer: "revoked" if revoked else "member" for peer, _, _, revoked in store.members()}
    peers: dict[str, list[invites.Report]] = {}
    for r in reports:
        peers.setdefault(r.reported, []).append(r)
    ranked = sorted(peers.items(), key=lambda kv: (-len({r.reporter for r in kv[1]}), -kv[1][-1].time))
    if args.json:
        print(json.dumps({"peers": [{"peer_id": peer, "state": standing.get(peer, "not a member"),
                                     "reporters": sorted({r.reporter for r in rs}), "reports": len(rs),
                                     "last": rs[-1].time, "reasons": sorted({r.reason for r in rs})}
                                    for peer, rs in ranked],
                          "reports": [vars(r) for r in reports]}, indent=2))
        return 0
    if not reports:
        print("No member has reported a peer.")
        return 0
    print(f"{'REPORTED PEER':<54} {'STATE':<12} {'BY':>3} {'LAST':<21} REASONS")
    for peer, rs in ranked:
        print(f"{peer:<54} {standing.get(peer, 'not a member'):<12} {len({r.reporter for r in rs}):>3} "
              f"{_when(rs[-1].time):<21} {'; '.join(sorted({r.reason for r in rs}))}")
    print("\nBY: distinct members whose workers banned the peer. Revoke one with: dedloc invite revoke "
          f"--run-dir {args.run_dir} PEER_ID")
    return 0


def _redeem(args: argparse.Namespace) -> int:
    from dedloc_core import invites as tokens
    from dedloc_core import paths

    identity = args.identity or paths.data_dir() / "identity.key"
    try:
        key = tokens.load_identity(Path(identity).read_bytes())
    except (OSError, ValueError) as exc:
        raise InviteError("invite_unconfigured", f"Cannot read this computer's identity {identity}: {exc}. "
                                                 "Start the app (or the worker) once to create it.") from None
    info = tokens.fetch_info(args.url)
    token = tokens.redeem(args.url, args.code, key, info["run_id"])
    claims = tokens.verify(token, tokens.load_public_key(info["invite_key"]), info["run_id"])
    if args.experiment:
        from dedloc_core import secrets

        secrets.set_invite(args.experiment, args.code)
        secrets.set_token(args.experiment, token)
    print(f"Invite accepted for run {claims.run_id} as {claims.peer_id}; token valid until {_when(claims.expires)} "
          "and renewed by the worker.")
    return 0


def _reporting(command):
    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except (DedlocError, OSError) as exc:
            return report(exc)
    return run


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("invite", help="invite-only experiments: make, list, revoke and redeem invites")
    commands = parser.add_subparsers(dest="invite_command", required=True)

    def run_dir(p: argparse.ArgumentParser) -> None:
        p.add_argument("--run-dir", type=Path, required=True, help="the backbone's run dir")

    keygen = commands.add_parser("keygen", help="make the issuer key (issuer.key in the run dir)")
    run_dir(keygen)
    keygen.set_defaults(func=_reporting(_keygen))
    create = commands.add_parser("create", help="make an invite code")
    run_dir(create)
    create.add_argument("--uses", type=int, default=1, help="how many computers it admits (default 1)")
    create.add_argument("--expires", help="redeemable for this long: 7d, 12h, 30m (default: no limit)")
    create.add_argument("--note", default="", help="a note for you (who it is for)")
    create.set_defaults(func=_reporting(_create))
    listing = commands.add_parser("list", help="the invites and the peers that redeemed them")
    run_dir(listing)
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(func=_reporting(_list))
    revoke = commands.add_parser("revoke", help="revoke an invite (its code or id) or one peer "
                                                "(its peer id: closes the code it used to new computers)")
    run_dir(revoke)
    revoke.add_argument("target", metavar="CODE|INVITE_ID|PEER_ID")
    revoke.set_defaults(func=_reporting(_revoke))
    reported = commands.add_parser("reports", help="peers that members' workers banned (to decide on revoking them)")
    run_dir(reported)
    reported.add_argument("--json", action="store_true")
    reported.set_defaults(func=_reporting(_reports))
    redeem = commands.add_parser("redeem", help="redeem an invite code at a backbone (volunteers)")
    redeem.add_argument("url", help="the backbone's URL (the experiment's invite_url)")
    redeem.add_argument("code")
    redeem.add_argument("--identity", type=Path, help="this computer's libp2p identity (default: the app's)")
    redeem.add_argument("--experiment", help="keep the code and token in the keyring for this experiment id")
    redeem.set_defaults(func=_reporting(_redeem))
    return parser
