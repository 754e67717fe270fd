"""An organizer's walk, end to end with the real commands: a folder of text files -> ``dedloc data
prepare`` -> a signed catalog with a declared transformers causal LM -> ``dedloc demo --catalog``
(a real backbone serving the token shards and the tokenizer, two real workers) -> the training loss
falls, and so does the backbone's loss on the held-out shard (``/swarm.json``), which the dashboard
plots in headless Chromium beside the training loss (artifacts/screens/dashboard-eval.png)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from conftest import tiny_experiment
from netlab.peers import signed_catalog

from dedloc_core.catalog import Experiment
from dedloc_core.organizer import dashboard

ROOT = Path(__file__).resolve().parents[1]
SCREENS = ROOT / "artifacts" / "screens"
CORPUS = ROOT / "resources" / "corpus"


def prepare(tmp_path: Path) -> dict:
    texts = tmp_path / "texts"
    texts.mkdir()
    for shard in sorted(CORPUS.glob("shard-*.txt"))[:2]:
        (texts / shard.name).write_text(shard.read_text(encoding="utf-8")[:150_000], encoding="utf-8")
    out = subprocess.run([sys.executable, "-m", "dedloc_core.cli", "data", "prepare", str(texts), "--out",
                          str(tmp_path / "shards"), "--seq-len", "64", "--vocab-size", "512"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads((tmp_path / "shards" / "catalog-entry.json").read_text())


@pytest.mark.slow
def test_an_organizers_own_data_and_model_train_in_a_swarm(tmp_path):
    entry = prepare(tmp_path)
    params = entry["recipe_params"]
    assert entry["recipe"] == "causal-lm" and params["config"]["vocab_size"] <= 512
    params["config"].update(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=4)  # a CPU-sized sibling of the prepared default
    params["optimizer"] = {"name": "adamw", "lr": 3e-3, "warmup_steps": 2}
    exp = tiny_experiment(id="organizer-lm", run_id="organizer_lm", recipe="causal-lm", recipe_params=params,
                          data=entry["data"], target_batch_size=64, batch_size_per_step=8)
    catalog, key = signed_catalog(exp, tmp_path / "catalog")
    out = subprocess.run([sys.executable, "-m", "dedloc_core.cli", "demo", "--steps", "10", "--timeout", "600",
                          "--experiment", "organizer-lm", "--catalog", str(catalog), "--trusted-key", str(key),
                          "--data-dir", str(tmp_path / "shards"), "--dir", str(tmp_path / "demo")],
                         cwd=ROOT, capture_output=True, text=True, timeout=700)
    text = out.stdout.replace("\r", "\n")
    assert out.returncode == 0, text[-2000:] + out.stderr[-2000:]
    first, last = map(float, re.search(r"First loss: ([\d.]+)\s+Last loss: ([\d.]+)", text).groups())
    assert last < first - 0.3, text[-1500:]  # ln(512) = 6.2 at the start
    trained = re.search(r"Trained (\d+) global steps with 2 volunteers", text)
    assert trained and int(trained.group(1)) >= 10, text[-1500:]  # the demo polls once a second: it may see more
    curve = json.loads((tmp_path / "demo" / "swarm.json").read_text())["learning_curve"]
    held_out = [(p["step"], p["eval_loss"]) for p in curve if p.get("eval_loss") is not None]
    assert len(held_out) >= 2 and held_out[0][0] == 0, curve  # the backbone evaluates from the start
    assert held_out[-1][1] < held_out[0][1] - 0.3, held_out  # on the held-out shard, as the dashboard plots it
    logs = (tmp_path / "demo" / "peer0.log").read_text()
    # the worker did not crash; a round that fails as the demo stops the peers (a traceback in
    # hivemind's log) is churn, not a crash
    assert "Ready to train" in logs and "Worker crashed" not in logs and "Worker stopped" not in logs
    dashboard_shows(tmp_path, exp, key.read_text().strip(), (tmp_path / "demo" / "swarm.json").read_bytes(),
                    held_out[-1])


def dashboard_shows(tmp_path: Path, exp: dict, key_line: str, swarm: bytes, last: tuple[int, float]) -> None:
    """The backbone's page with the demo's own /swarm.json: two curves, and the held-out loss in words."""
    from test_dashboard import chromium, serve

    page = dashboard.render(msgspec.convert(exp, Experiment), key_line)
    with serve(page, swarm) as server:
        dom = chromium(tmp_path, server.url, "--dump-dom")
        SCREENS.mkdir(parents=True, exist_ok=True)
        shot = SCREENS / "dashboard-eval.png"
        shot.unlink(missing_ok=True)
        chromium(tmp_path, server.url, f"--screenshot={shot}", "--window-size=1280,900")
    assert re.search(r'<path d="M[^"]+" class="curve">', dom)  # the volunteers' training loss
    assert re.search(r'<path d="M[^"]+" class="curve eval">', dom)  # the held-out loss
    note = re.search(r"Held-out loss ([\d.,]+) at step ([\d,]+) \(perplexity ([\d.,]+)\)", dom)
    assert note, dom[-3000:]
    shown_loss, shown_step, perplexity = (float(x.replace(",", "")) for x in note.groups())
    step, loss = last
    assert shown_step == step and abs(shown_loss - loss) < 6e-4 and abs(perplexity - math.exp(loss)) < 0.06, note
    assert shot.stat().st_size > 10_000
