"""Preferences: round-trip, validation, and broken files kept aside and replaced by defaults."""

from __future__ import annotations

import json
from datetime import time

import msgspec
import pytest

from dedloc_core import prefs
from dedloc_core.prefs import Preferences, TimeWindow


def test_round_trip(tmp_path):
    path = tmp_path / "preferences.json"
    mine = Preferences(consent=True, experiment_id="tiny-lm-demo", idle_minutes=5, upload_cap_kbs=200,
                       schedule=[TimeWindow(days=(4, 0), start=time(22, 0), end=time(6, 30))],
                       blocking_programs=[" game.exe ", ""])
    prefs.save(mine, path)
    loaded = prefs.load(path)
    assert loaded.warning is None
    assert loaded.prefs == mine
    assert loaded.prefs.schedule[0].days == (0, 4)
    assert loaded.prefs.blocking_programs == ["game.exe"]
    assert not list(tmp_path.glob("*.tmp"))


def test_missing_file_gives_defaults(tmp_path):
    loaded = prefs.load(tmp_path / "none.json")
    assert loaded.prefs == Preferences() and loaded.warning is None
    assert loaded.prefs.idle_only and loaded.prefs.idle_minutes == 3 and not loaded.prefs.run_on_battery


@pytest.mark.parametrize("content, problem", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "not valid JSON"),
    (json.dumps({"idle_minutes": -4}).encode(), "idle_minutes"),
    (json.dumps({"version": 99}).encode(), "version 99"),
    (b"\xff\xfe\x00garbage", "not valid JSON"),
])
def test_broken_file_is_kept_aside(tmp_path, content, problem):
    path = tmp_path / "preferences.json"
    path.write_bytes(content)
    loaded = prefs.load(path)
    assert loaded.prefs == Preferences()
    assert problem in loaded.warning and "defaults" in loaded.warning
    assert loaded.backup is not None and loaded.backup.read_bytes() == content
    assert not path.exists()


def test_unversioned_file_is_migrated(tmp_path):
    path = tmp_path / "preferences.json"
    path.write_text(json.dumps({"idle_only": False, "some_old_key": 1}))
    loaded = prefs.load(path)
    assert loaded.warning is None and loaded.prefs.idle_only is False


def test_invalid_values_are_refused():
    p = Preferences()
    with pytest.raises(AttributeError):  # frozen: a change is a new, validated value
        p.cpu_share_idle = 50  # type: ignore[misc]
    with pytest.raises(msgspec.ValidationError, match="cpu_share_idle"):
        prefs.validate({**prefs.to_json(p), "cpu_share_idle": 0})
    with pytest.raises(ValueError, match="weekdays"):
        TimeWindow(days=(7,))
    with pytest.raises(msgspec.ValidationError, match="weekdays"):
        prefs.validate({"schedule": [{"days": [7]}]})


def test_old_files_still_load(tmp_path):
    """A file as the pydantic version of the app wrote it, and times written without seconds."""
    path = tmp_path / "preferences.json"
    path.write_text(json.dumps({"version": 1, "consent": True, "idle_minutes": 5.0, "other_cpu_limit": 50,
                                "schedule": [{"days": [0, 4], "start": "22:00:00", "end": "06:30"}],
                                "upload_cap_kbs": "200"}))
    loaded = prefs.load(path)
    assert loaded.warning is None
    assert loaded.prefs.schedule == [TimeWindow(days=(0, 4), start=time(22), end=time(6, 30))]
    assert loaded.prefs.upload_cap_kbs == 200 and loaded.prefs.idle_minutes == 5.0


def test_schedule_text_round_trip():
    windows = prefs.parse_schedule("Mon-Fri 22:00-07:00; sat, sun 09:30-17:00; Sun-Mon 01:00-02:00")
    assert windows[0].days == (0, 1, 2, 3, 4) and windows[0].start == time(22) and windows[0].end == time(7)
    assert windows[1].days == (5, 6)
    assert windows[2].days == (0, 6)
    assert prefs.parse_schedule(prefs.format_schedule(windows)) == windows
    assert prefs.parse_schedule("  ") == []
    for bad in ("Mon 25:00-26:00", "Funday 10:00-11:00", "Mon-Fri", "Mon 10:00"):
        with pytest.raises(ValueError):
            prefs.parse_schedule(bad)


def test_the_worker_command_is_read_as_arguments_and_a_broken_one_is_refused():
    assert Preferences().worker_argv() is None  # the worker runs on this computer
    given = prefs.validate({"worker_command": "ssh 'my rig' dedloc worker"})
    assert given.worker_argv() == ["ssh", "my rig", "dedloc", "worker"]
    with pytest.raises(ValueError, match="worker command"):
        prefs.validate({"worker_command": "ssh 'my rig dedloc worker"})


def test_on_windows_the_worker_runs_in_the_wsl_distro_unless_told_otherwise(monkeypatch):
    monkeypatch.setattr(prefs.sys, "platform", "win32")
    assert Preferences().worker_argv() == ["wsl.exe", "-d", "DeDLOC", "--exec", "/usr/bin/dedloc", "worker"]
    assert prefs.validate({"worker_command": "ssh rig dedloc worker"}).worker_argv()[0] == "ssh"
    monkeypatch.setattr(prefs.sys, "platform", "linux")
    assert Preferences().worker_argv() is None
