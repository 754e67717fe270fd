"""Invite codes and access tokens in the OS keyring (never in a plain file). Calls may block (D-Bus, a
locked keyring): the app runs them off the GUI thread.

Keys (service ``dedloc-volunteer``): ``invite:<experiment id>`` the invite code a volunteer typed at
Join; ``token:<experiment id>`` the short-lived token the backbone issued for it (renewed by the
worker). A machine without a keyring gets a ``SecretError``, never a plain-file fallback."""

from __future__ import annotations

from .errors import DedlocError

SERVICE = "dedloc-volunteer"


class SecretError(DedlocError):
    title = "Keyring unavailable"


def _keyring():
    import keyring
    import keyring.errors

    return keyring, keyring.errors.KeyringError


def get_token(experiment_id: str) -> str | None:
    keyring, failure = _keyring()
    try:
        return keyring.get_password(SERVICE, f"token:{experiment_id}")
    except failure as exc:
        raise SecretError(f"Cannot read the access token from the system keyring: {exc}") from exc


def set_token(experiment_id: str, token: str) -> None:
    keyring, failure = _keyring()
    try:
        keyring.set_password(SERVICE, f"token:{experiment_id}", token)
    except failure as exc:
        raise SecretError(f"Cannot store the access token in the system keyring: {exc}. "
                          "Install or unlock a keyring (e.g. GNOME Keyring or KWallet).") from exc


def delete_token(experiment_id: str) -> None:
    keyring, failure = _keyring()
    try:
        keyring.delete_password(SERVICE, f"token:{experiment_id}")
    except keyring.errors.PasswordDeleteError:
        pass
    except failure as exc:
        raise SecretError(f"Cannot remove the access token from the system keyring: {exc}") from exc


def _get(key: str, what: str) -> str | None:
    keyring, failure = _keyring()
    try:
        return keyring.get_password(SERVICE, key)
    except failure as exc:
        raise SecretError(f"Cannot read the {what} from the system keyring: {exc}", code="keyring_unavailable",
                          hint="Install or unlock a keyring (e.g. GNOME Keyring or KWallet).") from exc


def _set(key: str, value: str, what: str) -> None:
    keyring, failure = _keyring()
    try:
        keyring.set_password(SERVICE, key, value)
    except failure as exc:
        raise SecretError(f"Cannot store the {what} in the system keyring: {exc}", code="keyring_unavailable",
                          hint="Install or unlock a keyring (e.g. GNOME Keyring or KWallet).") from exc


def _delete(key: str, what: str) -> None:
    keyring, failure = _keyring()
    try:
        keyring.delete_password(SERVICE, key)
    except keyring.errors.PasswordDeleteError:
        pass
    except failure as exc:
        raise SecretError(f"Cannot remove the {what} from the system keyring: {exc}",
                          code="keyring_unavailable") from exc


def get_invite(experiment_id: str) -> str | None:
    """The invite code stored for ``experiment_id``, or None."""
    return _get(f"invite:{experiment_id}", "invite code")


def set_invite(experiment_id: str, code: str) -> None:
    _set(f"invite:{experiment_id}", code, "invite code")


def delete_invite(experiment_id: str) -> None:
    _delete(f"invite:{experiment_id}", "invite code")
