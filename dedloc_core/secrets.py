"""Invite codes and access tokens in the OS keyring (never in a plain file). Calls may block (D-Bus, a locked
keyring): the app runs them off the GUI thread."""

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


def get_invite(experiment_id: str) -> str | None:
    keyring, failure = _keyring()
    try:
        return keyring.get_password(SERVICE, f"invite:{experiment_id}")
    except failure as exc:
        raise SecretError(f"Cannot read the invite code from the system keyring: {exc}") from exc


def set_invite(experiment_id: str, code: str) -> None:
    keyring, failure = _keyring()
    try:
        keyring.set_password(SERVICE, f"invite:{experiment_id}", code)
    except failure as exc:
        raise SecretError(f"Cannot store the invite code in the system keyring: {exc}. "
                          "Install or unlock a keyring (e.g. GNOME Keyring or KWallet).") from exc


def delete_invite(experiment_id: str) -> None:
    keyring, failure = _keyring()
    try:
        keyring.delete_password(SERVICE, f"invite:{experiment_id}")
    except keyring.errors.PasswordDeleteError:
        pass
    except failure as exc:
        raise SecretError(f"Cannot remove the invite code from the system keyring: {exc}") from exc
