"""The backbone's public dashboard: one self-contained HTML page (inline CSS and JS, no external asset).

``render(experiment, key_line, contact)`` returns the page. It shows the experiment, then polls
``swarm.json`` next to itself every 5 s (global step, samples/s, peers, the learning curve as inline
SVG, the leaderboard) and offers the ``dedloc://add?url=…&key=…`` link volunteers open in the app,
with the organizer key's fingerprint. Everything from the catalog is escaped here; everything from
``swarm.json`` goes in with ``textContent``. An invite-only experiment's ``swarm.json`` is its public view
for this page (the browser sends no token): display names and amounts, no peer ids (``stats.swarmview``).
A Content-Security-Policy allows only this page's own
script (by hash) and requests to its own origin.
"""

from __future__ import annotations

import base64
import hashlib
import html
import re

__all__ = ["render"]

POLL_SECONDS = 5

CSS = """
:root{--bg:#f6f7f9;--card:#fff;--ink:#1b1f24;--mute:#5b6470;--line:#e3e6ea;--acc:#2563eb;--ok:#15803d;--warn:#b45309}
*{box-sizing:border-box}
body{margin:0;background:var(--bg);color:var(--ink);font:15px/1.5 system-ui,-apple-system,"Segoe UI",sans-serif}
main{max-width:980px;margin:0 auto;padding:28px 20px 40px}
h1{font-size:28px;margin:0 0 4px}h2{font-size:17px;margin:0 0 12px}
.eyebrow{margin:0;color:var(--mute);font-size:13px;text-transform:uppercase;letter-spacing:.06em}
.meta,.small,.empty,#updated{color:var(--mute)}.small{font-size:13px}.desc{white-space:pre-line;max-width:70ch}
.badge{display:inline-block;padding:1px 9px;border-radius:99px;font-size:12px;background:#e5e7eb}
.badge.active{background:#dcfce7;color:var(--ok)}.badge.paused,.badge.upcoming{background:#fef3c7;color:var(--warn)}
.stats{display:grid;grid-template-columns:repeat(3,1fr);gap:14px;margin:20px 0 6px}
.tile,.card{background:var(--card);border:1px solid var(--line);border-radius:10px;padding:14px 18px}
.tile span{color:var(--mute);font-size:13px}.tile b{display:block;font-size:26px;font-variant-numeric:tabular-nums}
.card{margin-top:16px}#updated{font-size:13px;margin:0}.warn{color:var(--warn);font-weight:600}
svg{width:100%;height:auto;display:block}svg text{fill:var(--mute);font-size:12px}
.grid{stroke:var(--line)}.axis{stroke:#9aa3ad}.curve{fill:none;stroke:var(--acc);stroke-width:2}
.dot{fill:var(--acc)}.title{font-size:13px;fill:var(--ink)!important}
.curve.eval{stroke:var(--warn);stroke-dasharray:6 4}.dot.eval{fill:var(--warn)}
table{width:100%;border-collapse:collapse;font-variant-numeric:tabular-nums}
th,td{text-align:left;padding:7px 8px;border-bottom:1px solid var(--line)}
th{color:var(--mute);font-weight:500;font-size:13px}
td.n,th.n{text-align:right}.on{color:var(--ok)}.off{color:var(--mute)}
.button{display:inline-block;background:var(--acc);color:#fff;padding:9px 16px;border-radius:8px;
  text-decoration:none;font-weight:600}
code{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12.5px;word-break:break-all;background:#f0f2f5;
  padding:1px 4px;border-radius:4px}
.invite{border-left:3px solid var(--warn);padding-left:10px}
@media(max-width:640px){.stats{grid-template-columns:1fr}h1{font-size:23px}}
"""

SCRIPT = """
"use strict";
const $ = (id) => document.getElementById(id);
const NS = "http://www.w3.org/2000/svg";
let lastOk = 0, failing = false;

function el(tag, text, cls) {
  const e = document.createElement(tag);
  if (text !== undefined) e.textContent = text;
  if (cls) e.className = cls;
  return e;
}
function svg(tag, attrs, text) {
  const e = document.createElementNS(NS, tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (text !== undefined) e.textContent = text;
  return e;
}
const shortId = (id) => (id.length > 8 ? "\\u2026" + id.slice(-8) : id);
const num = (x, digits) => Number(x || 0).toLocaleString("en-US", {maximumFractionDigits: digits});
const pad = (n) => String(n).padStart(2, "0");
function hms(seconds) {
  const s = Math.max(0, Math.round(Number(seconds) || 0));
  return Math.floor(s / 3600) + ":" + pad(Math.floor(s / 60) % 60) + ":" + pad(s % 60);
}
function ticks(lo, hi, count, integer) {
  const raw = (hi - lo) / count, mag = Math.pow(10, Math.floor(Math.log10(raw)));
  let step = [1, 2, 2.5, 5, 10].map((k) => k * mag).find((s) => (hi - lo) / s <= count);
  if (integer) step = Math.max(1, Math.round(step));
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Number(v.toPrecision(12)));
  return out;
}

function series(points, key) {
  return points.filter((p) => typeof p[key] === "number" && isFinite(p[key])).map((p) => ({step: p.step, v: p[key]}));
}

function drawCurve(points) {
  const box = $("curve"), train = series(points, "loss"), held = series(points, "eval_loss");
  const pts = train.concat(held);
  box.replaceChildren();
  box.style.display = pts.length ? "" : "none";
  $("curve-empty").hidden = pts.length > 0;
  const last = held[held.length - 1];
  $("eval-note").textContent = last ? `Held-out loss ${num(last.v, 3)} at step ${num(last.step, 0)} ` +
    `(perplexity ${num(Math.exp(last.v), 1)}), measured by the backbone.` : "";
  if (!pts.length) return;
  const W = 900, H = 300, L = 64, R = 20, T = 14, B = 50;
  const steps = pts.map((p) => p.step), losses = pts.map((p) => p.v);
  let x0 = Math.min(...steps), x1 = Math.max(...steps), y0 = Math.min(...losses), y1 = Math.max(...losses);
  if (x0 === x1) { x0 = Math.max(0, x0 - 1); x1 += 1; }
  const margin = (y1 - y0) * 0.08 || Math.abs(y0) * 0.1 || 1;
  y0 -= margin; y1 += margin;
  const X = (s) => L + ((s - x0) / (x1 - x0)) * (W - L - R), Y = (v) => T + (1 - (v - y0) / (y1 - y0)) * (H - T - B);
  box.setAttribute("viewBox", `0 0 ${W} ${H}`);
  for (const t of ticks(y0, y1, 6, false)) {
    box.append(svg("line", {x1: L, x2: W - R, y1: Y(t), y2: Y(t), class: "grid"}));
    box.append(svg("text", {x: L - 8, y: Y(t) + 4, "text-anchor": "end"}, num(t, 3)));
  }
  for (const t of ticks(x0, x1, 8, true)) {
    box.append(svg("line", {x1: X(t), x2: X(t), y1: H - B, y2: H - B + 5, class: "axis"}));
    box.append(svg("text", {x: X(t), y: H - B + 19, "text-anchor": "middle"}, num(t, 0)));
  }
  box.append(svg("line", {x1: L, x2: W - R, y1: H - B, y2: H - B, class: "axis"}));
  box.append(svg("line", {x1: L, x2: L, y1: T, y2: H - B, class: "axis"}));
  box.append(svg("text", {x: L + (W - L - R) / 2, y: H - 8, "text-anchor": "middle", class: "title"}, "global step"));
  box.append(svg("text", {x: 16, y: T + (H - T - B) / 2, "text-anchor": "middle", class: "title",
                          transform: `rotate(-90 16 ${T + (H - T - B) / 2})`}, "loss"));
  let key = 0;  // a legend in the top right corner: labels at the lines' ends overlapped where they met
  for (const [line, cls, label] of [[train, "", "training (volunteers' batches)"], [held, " eval", "held-out"]]) {
    if (!line.length) continue;
    const d = line.map((p, i) => (i ? "L" : "M") + X(p.step) + " " + Y(p.v)).join(" ");
    box.append(svg("path", {d, class: "curve" + cls}));
    const ky = T + 10 + 18 * key++;
    box.append(svg("path", {d: `M${W - R - 250} ${ky} L${W - R - 222} ${ky}`, class: "curve" + cls}));
    box.append(svg("text", {x: W - R - 214, y: ky + 4, class: "title"}, label));
    if (line.length <= 60) {
      for (const p of line) box.append(svg("circle", {cx: X(p.step), cy: Y(p.v), r: 3, class: "dot" + cls}));
    }
  }
}

function drawBoard(board) {
  const body = $("board");
  body.replaceChildren();
  board.forEach((c, i) => {
    const name = el("td", String(c.display_name || "").trim() || shortId(String(c.peer_id || "")) || "(no name)");
    name.title = String(c.peer_id || "");
    const row = el("tr");
    const state = c.active ? el("td", "\\u25cf active", "on") : el("td", "idle", "off");
    row.append(el("td", String(i + 1), "n"), name, el("td", num(c.samples, 0), "n"),
               el("td", hms(c.compute_seconds), "n"), state);
    body.append(row);
  });
  $("board-empty").hidden = board.length > 0;
}

function tick() {
  const ago = lastOk ? "updated " + Math.round((Date.now() - lastOk) / 1000) + " s ago" : "";
  $("updated").textContent = failing ? "swarm status unavailable, retrying" + (ago ? " (last " + ago + ")" : "")
                                     : ago || "loading swarm status\\u2026";
  $("updated").className = failing ? "warn" : "";
}

async function refresh() {
  try {
    const response = await fetch("swarm.json", {cache: "no-store", signal: AbortSignal.timeout(4000)});
    if (!response.ok) throw new Error("HTTP " + response.status);
    const s = await response.json();
    $("step").textContent = num(s.global_step, 0);
    $("sps").textContent = num(s.samples_per_second, 1);
    $("peers").textContent = num(s.num_peers, 0);
    drawCurve(Array.isArray(s.learning_curve) ? s.learning_curve : []);
    drawBoard(Array.isArray(s.leaderboard) ? s.leaderboard : []);
    lastOk = Date.now();
    failing = false;
  } catch (err) {
    failing = true;
  }
  tick();
  setTimeout(refresh, POLL_MS);
}

const add = $("add");
if (add) {
  const catalog = new URL("catalog.json", location.href).href;
  add.href = "dedloc://add?url=" + encodeURIComponent(catalog) + "&key=" + encodeURIComponent(add.dataset.key);
  $("add-text").textContent = add.href;
}
setInterval(tick, 1000);
refresh();
""".replace("POLL_MS", str(POLL_SECONDS * 1000))

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; connect-src 'self'; img-src data:; \
style-src 'unsafe-inline'; script-src '{{script_hash}}'; base-uri 'none'; form-action 'none'">
<link rel="icon" href="data:,">
<title>{{title}} · DeDLOC</title>
<style>{{css}}</style></head>
<body><main>
<header>
<p class="eyebrow">DeDLOC volunteer experiment</p>
<h1>{{title}}</h1>
<p class="meta">by {{organizer}} · <span class="badge {{status}}">{{status}}</span></p>
<p class="desc">{{description}}</p>
</header>
<section class="stats">
<div class="tile"><span>Global step</span><b id="step">–</b></div>
<div class="tile"><span>Samples / s</span><b id="sps">–</b></div>
<div class="tile"><span>Active peers</span><b id="peers">–</b></div>
</section>
<p id="updated">loading swarm status…</p>
<section class="card"><h2>Learning curve</h2>
<svg id="curve" role="img" aria-label="loss against global step"></svg>
<p id="curve-empty" class="empty">No learning curve yet: it appears after the first global step.</p>
<p id="eval-note" class="small"></p></section>
<section class="card"><h2>Leaderboard</h2>
<table><thead><tr><th class="n">#</th><th>Volunteer</th><th class="n">Samples</th>
<th class="n">Compute time</th><th>Status</th></tr></thead><tbody id="board"></tbody></table>
<p id="board-empty" class="empty">No contributions yet.</p></section>
<section class="card" id="volunteer"><h2>Volunteer</h2>
{{volunteer}}
</section>
</main>
<script>{{script}}</script>
</body></html>
"""


def _volunteer(experiment, key_line: str | None, contact: str) -> str:
    parts = []
    if experiment.needs_token:
        contact_line = f"<br>Contact: {html.escape(contact.strip())}" if contact.strip() else ""
        parts.append(f'<p class="invite">This experiment is invite-only: ask {html.escape(experiment.organizer)} '
                     f"for an invite code.{contact_line}</p>")
    if key_line:
        from dedloc_core.catalog.signing import key_id, parse_public_key, public_key_line

        key = parse_public_key(key_line)
        key_b64 = public_key_line(key).split()[1]
        parts += [
            "<p>Install DeDLOC Volunteer, then open this link:</p>",
            f'<p><a id="add" class="button" data-key="{html.escape(key_b64)}">Add this experiment</a></p>',
            '<p class="small">The link: <code id="add-text"></code></p>',
            f'<p class="small">Organizer key fingerprint: <code id="fingerprint">{key_id(key)}</code> '
            "(the app checks the catalog against this key).</p>",
        ]
    else:
        parts.append("<p>The organizer's key is not published here: ask the organizer for the experiments link.</p>")
    return "\n".join(parts)


def render(experiment, key_line: str | None, contact: str = "") -> bytes:
    """The dashboard page for ``experiment`` (a catalog ``Experiment``); ``key_line`` is the
    organizer's public key line (``ed25519 <base64> [comment]``) for the volunteer link."""
    script_hash = "sha256-" + base64.b64encode(hashlib.sha256(SCRIPT.encode()).digest()).decode()
    values = {
        "title": html.escape(experiment.title),
        "organizer": html.escape(experiment.organizer),
        "status": html.escape(experiment.status),
        "description": html.escape(experiment.description),
        "volunteer": _volunteer(experiment, key_line, contact),
        "css": CSS,
        "script": SCRIPT,
        "script_hash": script_hash,
    }
    return re.sub(r"\{\{(\w+)\}\}", lambda m: values[m.group(1)], PAGE).encode("utf-8")
