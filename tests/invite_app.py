"""Drive the real app through an invite-only Join (run by tests/test_app_invite.py).

    python tests/invite_app.py OUT_DIR EXPERIMENT_ID CODE BACKBONE_RUN_DIR

The environment gives DISPLAY (Xvfb with a tray host), DEDLOC_HOME, the backbone's catalog
(DEDLOC_CATALOG_URL, DEDLOC_TRUSTED_KEYS, DEDLOC_INITIAL_PEERS) and a session bus with an unlocked
Secret Service. Selects the experiment, clicks Join, types the code into the dialog Join opens,
trains; then the organizer revokes the code (``dedloc invite revoke``) and the app must leave and
say why. Prints one JSON line with what it saw.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

os.environ["QT_QPA_PLATFORM"] = "xcb"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import QApplication, QInputDialog
from screens_app import pump, shoot, start_app, wait_until

from dedloc_core import secrets


def main() -> int:
    out, experiment, code, run_dir = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    out.mkdir(parents=True, exist_ok=True)
    app = start_app()
    notes: list[list[str]] = []
    app.controller.notify.connect(lambda title, message: notes.append([title, message]))
    app.controller.start()
    wait_until(lambda: app.controller.experiment(experiment) is not None, 120, "the gated experiment")
    page = app.window.show_page("Experiments")
    app.show_window()
    for i in range(page.list.count()):
        if page.list.item(i).data(Qt.ItemDataRole.UserRole) == experiment:
            page.list.setCurrentRow(i)
    asked: dict = {}

    def type_code() -> None:  # what the volunteer does in the dialog Join opens
        dialog = QApplication.activeModalWidget()
        if not isinstance(dialog, QInputDialog):
            QTimer.singleShot(200, type_code)
            return
        asked["label"] = dialog.labelText()
        dialog.setTextValue(code)
        asked["shot"] = shoot(out, "invite-code")
        dialog.accept()

    QTimer.singleShot(300, type_code)
    page.join_selected()  # modal until the code is typed
    wait_until(lambda: app.controller.status.state == "training", 240, "training with the invite")
    stored = secrets.get_invite(experiment)
    subprocess.run([sys.executable, "-m", "dedloc_core.cli", "invite", "revoke", "--run-dir", run_dir, code],
                   check=True, capture_output=True, timeout=60)
    wait_until(lambda: experiment in app.controller.invite_problems, 180, "the app to see the revoked invite")
    pump(1)
    page.show_details()
    details = page.details.text()
    saved = [asked.get("shot"), shoot(out, "invite-revoked")]
    exits: list[int] = []
    app.qapp = type("Exit", (), {"exit": staticmethod(exits.append)})()
    app.quit()
    wait_until(lambda: exits, 90, "the app to quit")
    print(json.dumps({"label": asked.get("label"), "stored": stored, "notes": notes, "details": details,
                      "joined": app.controller.joined.id if app.controller.joined else None,
                      "prefs_joined": app.controller.prefs.experiment_id, "saved": saved}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
