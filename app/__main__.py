"""``python -m app``: the tray app."""

import sys

from app.main import main

sys.exit(main())
