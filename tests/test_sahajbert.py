"""sahajBERT in the catalog (installers/catalog/default.json, the source of the shipped catalog): its
entry is DeDLOC's configuration and the fit check says it needs a GPU; its data is what ``dedloc data
prepare`` makes of the shipped corpus, file for file (the pins are that command's output); and its
CPU-sized sibling, on the same tokenizer and shards, trains in a real swarm of two workers."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from netlab.peers import signed_catalog

from dedloc_core.catalog import Experiment, validate_catalog
from dedloc_core.catalog.declared import fit
from dedloc_core.catalog.recipes import validate_params

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "installers" / "catalog" / "default.json"
# the command in the README's organizer section that made the entries' data
PREPARE = ["data", "prepare", str(ROOT / "resources" / "corpus"), "--kind", "masked", "--seq-len", "512",
           "--vocab-size", "32000"]


def entries() -> dict[str, Experiment]:
    catalog = validate_catalog(json.loads(SOURCE.read_text()))
    return {e.id: e for e in catalog.experiments if e.id.startswith("sahajbert")}


def family(params) -> str:
    return type(params).__struct_config__.tag


def test_sahajbert_has_dedlocs_configuration_and_needs_a_gpu():
    exp = entries()["sahajbert"]
    params = validate_params(exp.recipe, exp.recipe_params)
    assert (family(params), params.seq_len, exp.target_batch_size) == ("albert", 512, 4096)
    c = params.config
    assert (c.vocab_size, c.embedding_size, c.hidden_size, c.num_hidden_layers, c.num_hidden_groups) == \
        (32000, 128, 1024, 24, 1)  # factorized embeddings, one set of layer weights shared by all 24
    assert params.optimizer.name == "lamb"
    needs = exp.needs()
    assert needs.gpu_required and needs.gpu_memory_gb >= 8, needs
    assert "needs a GPU with" in fit(params, exp.batch_size_per_step).text()
    sibling = entries()["sahajbert-cpu"]
    assert not sibling.needs().gpu_required
    assert sibling.data == exp.data  # one preparation, two models
    sp = validate_params(sibling.recipe, sibling.recipe_params)
    assert (family(sp), sp.seq_len, sp.config.vocab_size, sp.optimizer.name) == ("albert", 512, 32000, "lamb")


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sahajbert") / "shards"
    run = subprocess.run([sys.executable, "-m", "dedloc_core.cli", *PREPARE, "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    return out


@pytest.mark.slow
def test_the_pinned_data_is_what_prepare_makes_of_the_shipped_corpus(shards):
    made = json.loads((shards / "catalog-entry.json").read_text())["data"]
    pinned = entries()["sahajbert"].data
    assert [f["sha256"] for f in made["shards"]] == [s.sha256 for s in pinned.shards]
    assert made["tokenizer"]["sha256"] == pinned.tokenizer.sha256
    assert made["eval"]["sha256"] == pinned.eval.sha256


@pytest.mark.slow
def test_the_cpu_sibling_trains_in_a_swarm(shards, tmp_path):
    exp = json.loads(SOURCE.read_text())
    sibling = next(e for e in exp["experiments"] if e["id"] == "sahajbert-cpu")
    catalog, key = signed_catalog(sibling, tmp_path / "catalog")
    out = subprocess.run([sys.executable, "-m", "dedloc_core.cli", "demo", "--steps", "8", "--timeout", "600",
                          "--experiment", "sahajbert-cpu", "--catalog", str(catalog), "--trusted-key", str(key),
                          "--data-dir", str(shards), "--dir", str(tmp_path / "demo")],
                         cwd=ROOT, capture_output=True, text=True, timeout=700)
    text = out.stdout.replace("\r", "\n")
    assert out.returncode == 0, text[-2000:] + out.stderr[-2000:]
    first, last = map(float, re.search(r"First loss: ([\d.]+)\s+Last loss: ([\d.]+)", text).groups())
    assert last < first - 0.4, text[-1500:]  # ln(32000) = 10.4 at the start (the printed loss lags: a mean)
    trained = re.search(r"Trained (\d+) global steps with 2 volunteers", text)
    assert trained and int(trained.group(1)) >= 8, text[-1500:]  # the demo polls once a second: it may see more
