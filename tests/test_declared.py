"""Declared architectures (catalog/declared.py, engine/recipes/declared.py): the catalog checks a
declared transformers model and sizes it exactly; the worker builds it from the config alone and
trains it on token shards; bad declarations and bad shards get clear errors."""

from __future__ import annotations

import copy
import json

import msgspec
import numpy as np
import pytest
import torch
import transformers

from dedloc_core.catalog import declared, validate_catalog
from dedloc_core.catalog.recipes import validate_params
from dedloc_core.engine.recipes import load_recipe
from dedloc_core.engine.recipes.declared import Lamb, Schedule
from dedloc_core.errors import CatalogError, RecipeError, ShardError
from dedloc_core.policy.hardware import Gpu, Hardware

TINY = {
    "llama": dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  max_position_embeddings=64),
    "gpt2": dict(vocab_size=300, n_embd=32, n_layer=2, n_head=4, n_positions=64),
    "albert": dict(vocab_size=300, embedding_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                   intermediate_size=64, max_position_embeddings=64),
    "bert": dict(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                 max_position_embeddings=64),
    "roberta": dict(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                    max_position_embeddings=66, pad_token_id=0),
}
RECIPE = {"llama": "causal-lm", "gpt2": "causal-lm", "albert": "masked-lm", "bert": "masked-lm", "roberta": "masked-lm"}
HF = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
      "albert": ("AlbertConfig", "AlbertForMaskedLM"), "bert": ("BertConfig", "BertForMaskedLM"),
      "roberta": ("RobertaConfig", "RobertaForMaskedLM")}
# DeDLOC's sahajBERT: ALBERT-large, factorized 128-wide embeddings, all 24 layers sharing one
SAHAJBERT = dict(vocab_size=32000, embedding_size=128, hidden_size=1024, num_hidden_layers=24,
                 num_attention_heads=16, intermediate_size=4096, max_position_embeddings=512)


def params(family: str, seq_len: int = 32, **config):
    return validate_params(RECIPE[family], {"family": family, "seq_len": seq_len, "config": {**TINY[family], **config}})


def hf_count(family: str, config: dict) -> int:
    with torch.device("meta"):
        model = getattr(transformers, HF[family][1])(getattr(transformers, HF[family][0])(**config))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("family,extra", [
    ("llama", {}), ("llama", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    ("gpt2", {}), ("gpt2", dict(n_inner=50, tie_word_embeddings=False)),
    ("albert", {}), ("albert", dict(num_hidden_layers=4, num_hidden_groups=2, inner_group_num=2)),
    ("bert", {}), ("roberta", {}),
])
def test_the_parameter_count_is_the_one_transformers_builds(family, extra):
    assert declared.parameters(params(family, **extra)) == hf_count(family, {**TINY[family], **extra})


def test_sahajbert_sized_without_building_it():
    p = validate_params("masked-lm", {"family": "albert", "seq_len": 512, "config": SAHAJBERT})
    assert declared.parameters(p) == hf_count("albert", SAHAJBERT)  # ~18 M: ALBERT-large shares its layers
    f = declared.fit(p, batch_size=4)
    assert f.gpu_required and f.gpu_memory_gb >= 8  # activations of 4 x 512 tokens over 24 layers, fp32
    assert f"needs a GPU with {f.gpu_memory_gb:g} GB" in f.text()
    small = declared.fit(params("albert"), batch_size=4)
    assert not small.gpu_required and small.gpu_memory_gb is None


@pytest.mark.parametrize("change,needle", [
    ({"family": "mamba"}, "Unknown model family 'mamba'"),
    ({"config": {"hiden_size": 32}}, "config.hiden_size: unknown field"),
    ({"config": {"hidden_size": 30}}, "must be divisible by the number of attention heads"),
    ({"config": {"num_hidden_layers": 10_000}}, "config.num_hidden_layers"),
    ({"seq_len": 128}, "fewer than the 128 that seq_len 128 needs"),
    ({"optimizer": {"name": "sgd"}}, "optimizer.name"),
    ({"optimizer": {"lr": 5.0}}, "optimizer.lr"),
])
def test_bad_declarations_get_clear_errors(change, needle):
    p = {"family": "llama", "seq_len": 32, "config": dict(TINY["llama"])}
    for key, value in change.items():
        p[key] = {**p[key], **value} if isinstance(value, dict) and key == "config" else value
    with pytest.raises(RecipeError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        validate_params("causal-lm", p)


def catalog_with(recipe: str, recipe_params: dict, batch: int = 8) -> dict:
    base = msgspec.to_builtins(_default_catalog())
    exp = copy.deepcopy(base["experiments"][0])
    exp.update(id="declared", run_id="declared", recipe=recipe, recipe_params=recipe_params,
               batch_size_per_step=batch, target_batch_size=max(batch, exp["target_batch_size"]))
    base["experiments"] = [exp]
    return base


def _default_catalog():
    import tempfile
    from pathlib import Path

    from dedloc_core.catalog import CatalogStore

    return CatalogStore(Path(tempfile.mkdtemp()) / "last_good.json").load_default().catalog


def test_the_catalog_rejects_a_model_no_volunteer_fits():
    huge = dict(vocab_size=50000, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                num_attention_heads=64, max_position_embeddings=4096)
    with pytest.raises(CatalogError) as info:
        validate_catalog(catalog_with("causal-lm", {"family": "llama", "seq_len": 2048, "config": huge}))
    assert info.value.code == "invalid_value" and "fits no volunteer's GPU" in info.value.message


def test_an_experiment_needs_the_gpu_its_model_needs():
    cat = validate_catalog(catalog_with("masked-lm", {"family": "albert", "seq_len": 512, "config": SAHAJBERT}, 4))
    exp = cat.experiments[0]
    assert not exp.hardware.gpu_required  # the organizer did not say so
    needs = exp.needs()
    assert needs.gpu_required and needs.gpu_memory_gb == declared.fit(
        validate_params(exp.recipe, exp.recipe_params), 4).gpu_memory_gb
    cpu_only = Hardware("cpu", 8, 16, 64.0, 500.0)
    assert any(f"GPU with {needs.gpu_memory_gb:g} GB" in lack for lack in cpu_only.unmet(needs))
    small_gpu = Hardware("cpu", 8, 16, 64.0, 500.0, gpus=[Gpu("GeForce GTX 1050", 2048, "550")])
    assert any("this computer's has 2.0 GB" in lack for lack in small_gpu.unmet(needs))
    big_gpu = Hardware("cpu", 8, 16, 64.0, 500.0, gpus=[Gpu("RTX A6000", 49140, "550")])
    assert big_gpu.unmet(needs) == []


def test_schedules():
    assert [round(Schedule(3, "constant", 10, 0.0)(s), 3) for s in (0, 2, 3, 9)] == [0.25, 0.75, 1.0, 1.0]
    linear = Schedule(0, "linear", 10, 0.1)
    assert linear(0) == 1.0 and linear(10) == pytest.approx(0.1) and linear(5) == pytest.approx(0.55)
    cosine = Schedule(2, "cosine", 12, 0.0)
    assert cosine(2) == 1.0 and cosine(7) == pytest.approx(0.5) and cosine(12) == pytest.approx(0.0)


def write_rows(path, rows: np.ndarray):
    np.save(path, rows)
    return path


def corpus_rows(seq_len: int, n: int = 256, used: int = 32) -> np.ndarray:
    """Rows with structure to learn: ``used`` of the ids (from 5), token t+1 a function of token t."""
    rows = np.empty((n, seq_len), dtype=np.uint16)
    rows[:, 0] = np.random.default_rng(0).integers(5, 5 + used, size=n)
    for i in range(1, seq_len):
        rows[:, i] = ((rows[:, i - 1].astype(np.int64) - 5) * 7 + 3) % used + 5
    return rows


@pytest.mark.parametrize("family,optimizer", [("llama", "lamb"), ("gpt2", "lamb"), ("albert", "adamw"),
                                              ("bert", "adamw"), ("roberta", "adamw")])
def test_each_family_trains_on_token_shards(tmp_path, family, optimizer):
    lr = 2e-2 if optimizer == "lamb" else 3e-3  # LAMB scales each step by ||w|| / ||update||
    p = {"family": family, "seq_len": 32, "config": TINY[family], "optimizer": {"name": optimizer, "lr": lr}}
    recipe = load_recipe(RECIPE[family], p)
    if RECIPE[family] == "masked-lm":  # [CLS] row [SEP] with the prepare tool's ids
        rows = corpus_rows(32)
        rows[:, 0], rows[:, -1] = 2, 3
    else:
        rows = corpus_rows(32)
    shard = write_rows(tmp_path / "shard-00000.npy", rows)
    model = recipe.build_model(seed=0)
    assert isinstance(model, getattr(transformers, HF[family][1]))
    opt = recipe.build_optimizer(model.parameters())
    assert isinstance(opt, Lamb) == (optimizer == "lamb")
    before = recipe.evaluate(model, [shard], max_batches=2)
    batches = recipe.batches([shard], 16, seed=1)
    for _ in range(30):
        recipe.loss(model, next(batches)).backward()
        opt.step()
        opt.zero_grad()
    after = recipe.evaluate(model, [shard], max_batches=2)
    assert after < 0.8 * before, (before, after)


@pytest.mark.parametrize("family", ["albert", "bert", "roberta"])
def test_the_masked_loss_is_transformers_own_on_the_masked_rows_only(family):
    recipe = load_recipe("masked-lm", {"family": family, "seq_len": 32, "config": TINY[family]})
    model = recipe.build_model(seed=0).eval()  # (no dropout: both passes see the same network)
    rows = torch.from_numpy(corpus_rows(32)[:6].astype(np.int64))
    rows[:, 0], rows[:, -1] = 2, 3
    batch = recipe._masked(rows, torch.Generator().manual_seed(0))
    theirs = model(input_ids=batch.input_ids, labels=batch.labels).loss
    ours = recipe.loss(model, batch)
    assert torch.allclose(ours, theirs, atol=1e-6), (ours, theirs)
    grads = [torch.autograd.grad(x, list(model.parameters()), allow_unused=True) for x in (theirs, ours)]
    for a, b in zip(*grads, strict=True):
        assert (a is None) == (b is None) and (a is None or torch.allclose(a, b, atol=1e-6))


def test_bad_shards_and_tokenizers_get_clear_errors(tmp_path):
    recipe = load_recipe("causal-lm", {"family": "llama", "seq_len": 32, "config": TINY["llama"]})
    wide = write_rows(tmp_path / "wide.npy", corpus_rows(64))
    with pytest.raises(ShardError, match="wide.npy holds uint16 rows of shape \\(64,\\); the model takes integer "
                                         "rows of 32 tokens"):
        next(recipe.batches([wide], 4, seed=0))
    big = corpus_rows(32)
    big[3, 5] = 4000
    with pytest.raises(ShardError, match="token id 4000, outside the model's vocabulary of 300"):
        next(recipe.batches([write_rows(tmp_path / "big.npy", big)], 4, seed=0))
    text = tmp_path / "text.npy"
    text.write_text("not an array")
    with pytest.raises(ShardError, match="text.npy is not a token array"):
        next(recipe.batches([text], 4, seed=0))
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(500)}, unk_token="w0"))
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(RecipeError, match="has 500 tokens, more than the model's vocabulary of 300"):
        load_recipe("causal-lm", {"family": "llama", "seq_len": 32, "config": TINY["llama"]},
                    tmp_path / "tokenizer.json")
    small = Tokenizer(models.WordLevel({f"w{i}": i for i in range(100)}, unk_token="w0"))
    small.save(str(tmp_path / "small.json"))
    with pytest.raises(RecipeError, match=r"lacks \[PAD\], \[CLS\], \[SEP\], \[MASK\]"):
        load_recipe("masked-lm", {"family": "bert", "seq_len": 32, "config": TINY["bert"]}, tmp_path / "small.json")


@pytest.mark.parametrize("declared_params,needle", [
    ({"family": "mamba", "seq_len": 32, "config": {}}, "Unknown model family 'mamba'"),
    ({"family": "llama", "seq_len": 2048, "config": dict(vocab_size=50000, hidden_size=8192, intermediate_size=28672,
                                                          num_hidden_layers=80, num_attention_heads=64,
                                                          max_position_embeddings=4096)}, "fits no volunteer's GPU"),
])
def test_a_bad_declaration_keeps_the_last_good_catalog_and_says_why(tmp_path, declared_params, needle):
    from datetime import timedelta

    from test_catalog import NOW, catalog_dict, experiment, key_id, signed

    from dedloc_core.catalog import CatalogStore, generate_keypair, load_private_key

    pem, _ = generate_keypair("pw")
    key = load_private_key(pem, "pw")
    keys = {key_id(key.public_key()): key.public_key()}
    store = CatalogStore(tmp_path / "last.json", shipped=False)
    good = signed(catalog_dict(), key)
    assert store.accept(good, keys, now=NOW).error is None
    bad = signed_unchecked(catalog_dict(experiment(recipe="causal-lm", recipe_params=declared_params),
                                        issued=NOW + timedelta(hours=1)), key)
    result = store.accept(bad, keys, now=NOW + timedelta(hours=2))
    assert result.error is not None and needle in result.error.message, result.error
    assert result.from_last_good and result.catalog.experiments[0].recipe == "tiny-lm"
    assert store.path.read_bytes() == good


def signed_unchecked(cat: dict, key) -> bytes:
    """An envelope signed without this app's checks: what a newer app (which knows more families)
    or an organizer's own tool may publish."""
    import base64

    from test_catalog import key_id

    payload = json.dumps(cat)
    signature = base64.b64encode(key.sign(payload.encode())).decode()
    return json.dumps({"format": "dedloc-catalog/1", "key_id": key_id(key.public_key()), "signature": signature,
                       "payload": payload}).encode()
