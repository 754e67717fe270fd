"""The backbone's dashboard page: served over real HTTP, self-contained and escaped, and rendered by
headless Chromium against a real SwarmView (leaderboard, learning curve, the dedloc://add link; a
failing swarm.json). Saves artifacts/dashboard.png."""

from __future__ import annotations

import html
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from urllib.parse import quote

import msgspec
import pytest
from conftest import tiny_experiment

from dedloc_core.catalog import Experiment, generate_keypair, key_id, parse_public_key
from dedloc_core.organizer import dashboard
from dedloc_core.organizer.httpserve import FileServer
from dedloc_core.stats.swarmview import SwarmView

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "artifacts"
HTML = "text/html; charset=utf-8"
TITLE = "Tiny <script>alert(1)</script> LM"
EXTERNAL = re.compile(r"""(?:\bsrc|\bhref)\s*=\s*["']?\s*(?:https?:)?//|url\(\s*["']?\s*(?:https?:)?//|@import""", re.I)


@pytest.fixture(scope="module")
def key_line() -> str:
    return generate_keypair("test-pass", "organizer")[1]


def experiment(**overrides) -> Experiment:
    return msgspec.convert(tiny_experiment(title=TITLE, organizer="Ada & co", **overrides), Experiment)


def swarm_view() -> SwarmView:
    view = SwarmView("tiny_lm_test")
    now = time.time()
    for step in range(1, 41):
        view.add_point({"time": now - 400 + 10 * step, "step": step, "loss": round(2 + 4 / step, 4),
                        "samples_per_second": 40.0, "num_peers": 3})
    view.add_record("QmAliceAAAAAAAAAAAAAAAA1", "Alice", 5200, 3723.4, now)
    view.add_record("QmNoNameBBBBBBBBBB12345678", "", 3100, 1800.0, now - 1000)
    view.add_record("QmMalloryCCCCCCCCCCCCCCC", "<img src=x onerror=alert(1)>", 90, 59.0, now)
    view.set_status(40, 123.5, 3)
    return view


def serve(page: bytes, swarm=None) -> FileServer:
    server = FileServer({"/index.html": page} | ({"/swarm.json": swarm} if swarm is not None else {}))
    server.add("/", page, content_type=HTML)
    return server


def get(url: str) -> tuple[int, str, str]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, response.headers["Content-Type"], response.read().decode()


def test_page_over_http_is_self_contained_and_escaped(key_line):
    page = dashboard.render(experiment(), key_line)
    with serve(page, swarm_view().to_json) as server:
        status, content_type, text = get(server.url)
        assert (status, content_type) == (200, HTML)
        assert get(server.url + "index.html")[:2] == (200, HTML)
        assert get(server.url + "swarm.json")[1] == "application/json"
    assert EXTERNAL.findall(text) == [], "the page loads something from elsewhere"
    assert f">{key_id(parse_public_key(key_line))}<" in text  # the fingerprint, shown
    assert html.escape(TITLE) in text and "<script>alert" not in text
    assert "by Ada &amp; co" in text
    assert "Install DeDLOC Volunteer, then open this link" in text
    assert f'data-key="{key_line.split()[1]}"' in text
    assert "invite-only" not in text
    assert "fetch(\"swarm.json\"" in text  # relative: next to the page, wherever it is served


def test_invite_only_experiment_says_whom_to_ask(key_line):
    text = dashboard.render(experiment(needs_token=True), key_line, contact="mail <invites@example.org>").decode()
    assert "This experiment is invite-only: ask Ada &amp; co for an invite code" in text
    assert "Contact: mail &lt;invites@example.org&gt;" in text
    assert "Contact:" not in dashboard.render(experiment(needs_token=True), key_line).decode()
    without_key = dashboard.render(experiment(), None).decode()
    assert 'id="add"' not in without_key and "ask the organizer for the experiments link" in without_key


def chromium(tmp_path: Path, url: str, *args: str, budget_ms: int = 5000) -> str:
    binary = shutil.which("chromium")
    if binary is None:
        pytest.skip("no chromium binary on PATH (Debian: apt-get install chromium)")
    command = [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
               f"--user-data-dir={tmp_path / 'chromium-profile'}", f"--virtual-time-budget={budget_ms}", *args, url]
    out = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def rows(dom: str) -> list[list[str]]:
    body = re.search(r'<tbody id="board">(.*?)</tbody>', dom, re.S)
    assert body, dom[-3000:]
    return [[html.unescape(cell) for cell in re.findall(r"<td[^>]*>(.*?)</td>", row, re.S)]
            for row in re.findall(r"<tr[^>]*>(.*?)</tr>", body.group(1), re.S)]


@pytest.mark.slow  # a headless browser
def test_dashboard_in_headless_chromium(tmp_path, key_line):
    page = dashboard.render(experiment(needs_token=True), key_line, contact="invites@example.org")
    with serve(page, swarm_view().to_json) as server:
        url = server.url
        dom = chromium(tmp_path, url, "--dump-dom")
        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / "dashboard.png"
        shot.unlink(missing_ok=True)
        chromium(tmp_path, url, f"--screenshot={shot}", "--window-size=1280,900")
    board = rows(dom)
    assert [r[1] for r in board] == ["Alice", "…12345678", "<img src=x onerror=alert(1)>"]  # as text, in order
    assert board[0] == ["1", "Alice", "5,200", "1:02:03", "● active"]
    assert board[1][3:] == ["0:30:00", "idle"]
    assert re.search(r'<b id="step">40</b>', dom) and re.search(r'<b id="peers">3</b>', dom)
    assert ">global step</text>" in dom and ">loss</text>" in dom
    assert re.search(r'<path d="M[^"]+" class="curve">', dom) and '<p id="curve-empty" class="empty" hidden' in dom
    catalog = quote(url + "catalog.json", safe="!~*'()")
    key = quote(key_line.split()[1], safe="!~*'()")
    assert f'href="dedloc://add?url={catalog}&amp;key={key}"' in dom
    assert re.search(r'<p id="updated" class="">updated \d+ s ago</p>', dom)
    assert "This experiment is invite-only" in dom
    assert shot.stat().st_size > 10_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # a headless browser
def test_dashboard_when_swarm_json_fails(tmp_path, key_line):
    page = dashboard.render(experiment(), key_line)
    with serve(page) as server:  # no /swarm.json: every fetch gets a 404
        dom = chromium(tmp_path, server.url, "--dump-dom", budget_ms=8000)
        tries = server.count("/swarm.json")
    assert '<p id="updated" class="warn">swarm status unavailable, retrying</p>' in dom
    assert tries >= 2, "the page did not retry"
    assert '<p id="curve-empty" class="empty">No learning curve yet' in dom and rows(dom) == []  # shown
    assert 'href="dedloc://add?url=' in dom  # the rest of the page still works
