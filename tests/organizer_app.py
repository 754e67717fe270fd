"""Drive the real app from an organizer's link to training (run by tests/test_organizer_flow.py).

    python tests/organizer_app.py OUT_DIR LINK EXPERIMENT_ID

The environment gives DISPLAY (Xvfb with a window manager and a tray host), DEDLOC_HOME (consent
given, contribute any time, a display name), DEDLOC_LISTEN and DEDLOC_INITIAL_PEERS (the backbone).
Opens the link as the desktop's scheme handler would, trusts the organizer in the Add experiments
dialog, joins, trains until the backbone's leaderboard lists this volunteer, saves screenshots,
quits, and prints one JSON line with what it saw.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["QT_QPA_PLATFORM"] = "xcb"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from screens_app import pump, shoot, start_app, wait_until

from dedloc_core.stats.swarmview import SwarmUnavailable, fetch_summary


def main() -> int:
    out, link, experiment = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    out.mkdir(parents=True, exist_ok=True)
    app = start_app()
    app.controller.start()
    wait_until(lambda: app.controller.catalog is not None, 60, "the catalog")
    app.open_link(link)  # what `dedloc app dedloc://add?...` does in the running app
    dialog = app.window.pages["Experiments"].add_dialog
    wait_until(dialog.trust_button.isEnabled, 120, "the organizer's catalog to be checked")
    info = dialog.info.text()
    saved = [shoot(out, "add-experiments")]
    dialog.trust_button.click()
    wait_until(lambda: app.controller.experiment(experiment) is not None, 120, "the organizer's experiments")
    if not app.controller.join(experiment):
        raise SystemExit("join refused")
    wait_until(lambda: app.controller.status.state == "training" and app.controller.last_progress, 240,
               "training progress")
    url = app.controller.origin(experiment).rsplit("/", 1)[0] + "/swarm.json"
    name = app.controller.prefs.display_name

    def listed() -> bool:
        try:
            return any(c.display_name == name for c in fetch_summary(url, timeout=5).leaderboard)
        except SwarmUnavailable:
            return False

    wait_until(listed, 180, "this volunteer on the backbone's leaderboard")
    app.controller.refresh_stats()
    wait_until(lambda: app.controller.rank() is not None, 60, "this volunteer's rank")
    page = app.window.show_page("Experiments")
    app.show_window()
    pump(1)
    details = page.details.text()
    saved.append(shoot(out, "experiments-from-organizer"))
    items = [page.list.item(i).text() for i in range(page.list.count())]
    exits: list[int] = []
    app.qapp = type("Exit", (), {"exit": staticmethod(exits.append)})()
    app.quit()
    wait_until(lambda: exits, 90, "the worker to stop")
    print(json.dumps({"saved": saved, "dialog": info, "details": details, "items": items}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
