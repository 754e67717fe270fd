"""DeDLOC Volunteer tray app (PySide6). Never imports torch or hivemind: training runs in a worker
process that the supervisor owns.

The code is organized as follows:

- ``main``: ``dedloc app``: the QApplication, single instance, first run, tray and window.
- ``bridge``: runs blocking work on background threads and delivers results on the GUI thread.
- ``supervisor``: owns the worker process; commands in, typed Qt signals out; restarts, reaping.
- ``controller``: the app's state: preferences, catalog, user pause/snooze, status line.
- ``instance``: one running app per user; a second launch shows the first one's window.
- ``tray``: the tray icon and its menu.  ``icons``: state icons.
- ``window``: the main window; ``pages/``: one module per page (Join's dialogs: ``pages/experiments``
  and ``sources``).
- ``windowhost``: with a tray, the window runs in its own process (``dedloc app --window``), fed the
  controller's state over the single-instance socket; ``remote``: that process's side (a mirror of
  the controller); ``channel``: JSON lines between the two.
- ``firstrun``: the welcome dialog (consent and first choices).
"""
