"""hivemind's matchmaking repeats one line every few seconds for a lone peer: it is said once."""

from __future__ import annotations

import logging

from hivemind.utils.logging import get_logger

from dedloc_core.engine.swarm import quiet_repeats

REPEATED = ("Another look_for_group is already in progress. The current run will be scheduled after"
            " the existing group is either assembled or disbanded.")


class Keep(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_the_lone_peer_line_is_said_once_and_other_lines_pass():
    log = get_logger("hivemind.averaging.matchmaking")  # the logger hivemind's matchmaking module uses
    keep = Keep()
    log.addHandler(keep)
    old_level, log.level = log.level, logging.DEBUG
    try:
        quiet_repeats()
        quiet_repeats()  # idempotent: one filter, not two
        for _ in range(5):
            log.info(REPEATED)
            log.info("Averaging with %d peers", 3)
    finally:
        log.removeHandler(keep)
        log.setLevel(old_level)
    said = [r.getMessage() for r in keep.records]
    assert [m for m in said if m.startswith("Another look_for_group")] == [
        REPEATED + " (said once; repeats are not logged)"]
    assert said.count("Averaging with 3 peers") == 5
