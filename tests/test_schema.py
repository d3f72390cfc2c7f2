"""fastprompt.schema: each JSON file fastprompt reads is checked against its schema where it is read, so a bad file is
one line naming the file, the key and the expected type; random and adversarial JSON never gets further."""
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastprompt.io import read_json
from fastprompt.schema import check_json, expected


@dataclass
class Inner:
    EXTRA: ClassVar[str] = "forbid"
    n: int = field(metadata={"ge": 1})
    name: str | None = None


@dataclass
class Outer:
    inner: Inner
    values: list[float] = field(default_factory=list)
    pair: tuple[str, int] | None = None
    table: dict[str, int] = field(default_factory=dict)
    anything: Any = None


@pytest.mark.parametrize("data,message", [
    ([1], "f must be a JSON object, got [1]"),
    ({}, "f: key 'inner' is missing (expected an object)"),
    ({"inner": None}, "f: key 'inner' must be an object, got null"),
    ({"inner": {"n": "twelve"}}, "f: key 'inner.n' must be an integer, got 'twelve'"),
    ({"inner": {"n": True}}, "f: key 'inner.n' must be an integer, got true"),
    ({"inner": {"n": 0}}, "f: key 'inner.n' must be >= 1, got 0"),
    ({"inner": {"n": 1, "x": 2}}, "f: unknown key 'inner.x'; the object 'inner' holds only n, name"),
    ({"inner": {"n": 1}, "values": [1, "a"]}, "f: key 'values[1]' must be a number, got 'a'"),
    ({"inner": {"n": 1}, "pair": ["a"]}, "f: key 'pair' must be a list of 2: a string, an integer or null, got"),
    ({"inner": {"n": 1}, "table": {"k": 1.5}}, "f: key 'table.k' must be an integer, got 1.5"),
    ({"inner": {"n": 1}, "values": ["x" * 10**6]}, "f: key 'values[0]' must be a number, got 'xxxx"),
])
def test_one_line_names_the_key_and_the_type(data, message):
    with pytest.raises(ValueError) as info:
        check_json(data, Outer, "f")
    assert str(info.value).startswith(message) and len(str(info.value)) < 300, str(info.value)


def test_good_data_is_returned_unchanged_and_unknown_keys_pass_where_allowed():
    data = {"inner": {"n": 2, "name": None}, "values": [1, 2.5], "pair": ["a", 3], "other": [1]}
    assert check_json(data, Outer, "f") is data
    assert expected(list[int]) == "a list of integers" and expected(int | None) == "an integer or null"


def test_read_json_says_what_a_path_is(tmp_path):
    (tmp_path / "dir.json").mkdir()
    (tmp_path / "loop.json").symlink_to(tmp_path / "loop.json")
    (tmp_path / "dangling.json").symlink_to(tmp_path / "nowhere")
    (tmp_path / "deep.json").write_text("[" * 100000 + "]" * 100000)
    cases = [("dir.json", IsADirectoryError, "is a directory, not a file"),
             ("loop.json", OSError, "is a symbolic link loop"),
             ("dangling.json", FileNotFoundError, "is a broken symbolic link"),
             ("missing.json", FileNotFoundError, "x not found:"),
             ("deep.json", ValueError, "is nested too deeply")]
    for name, kind, message in cases:
        with pytest.raises(kind, match=message):
            read_json(tmp_path / name, "x")
    with pytest.raises(ValueError, match="is a character device"):
        read_json("/dev/null", "x")


# ------------------------------------------------------------------ every schema against random JSON
def _schemas():
    from fastprompt.data.replacements import ReplacementLine, ReplacementSettings
    from fastprompt.eval.report import RunSummaryFile
    from fastprompt.integrations.papers import TheirArguments
    from fastprompt.integrations.peft import PrefixAdapterConfig
    from fastprompt.integrations.sentence_transformers import ModuleConfig, RunSummary, TrainInfo
    from fastprompt.methods.skicse.generation.store import SkiMeta
    from fastprompt.model.backbone import ModelConfigFile
    from fastprompt.model.checkpoint import CheckpointFile
    from fastprompt.model.mlm_head import ShardIndex
    from fastprompt.train.checkpoints import TrainerRecord
    from fastprompt.train.state import TrainingStateFile

    return [CheckpointFile, TrainingStateFile, TrainerRecord, ModelConfigFile, ShardIndex, PrefixAdapterConfig,
            TheirArguments, SkiMeta, ReplacementLine, ReplacementSettings, ModuleConfig, TrainInfo, RunSummary,
            RunSummaryFile]


_JSON = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2**65, 2**65), st.floats(), st.text(max_size=8)),
                     lambda inner: st.one_of(st.lists(inner, max_size=4),
                                             st.dictionaries(st.text(max_size=12), inner, max_size=5)),
                     max_leaves=25)
# objects built from the schemas' own keys, so that the checks get past the first level
_KEYS = ["format", "base_model", "backbone", "prompt_config", "pooler", "mlp", "num_layers", "num_heads", "head_dim",
         "hidden_size", "format_version", "optimizer", "param_groups", "scalars", "scheduler", "base_lrs", "last_epoch",
         "scaler", "rng", "numpy", "python", "trainer", "state", "global_step", "dev_history", "data", "rows",
         "sha256", "weight_map", "peft_type", "token_dim", "num_virtual_tokens", "num_attention_heads", "ids",
         "replaced", "settings", "runs", "generator", "masking_ratio", "step", "test", "prompt_path", "params", "lr",
         "frozen_baseline", "same_pooling", "stsb_dev", "status", "sts12"]
_KEYED = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.floats(-2, 2), st.text(max_size=3)),
                      lambda inner: st.one_of(st.lists(inner, max_size=3),
                                              st.dictionaries(st.sampled_from(_KEYS), inner, max_size=6)),
                      max_leaves=40)


@settings(max_examples=200, deadline=None)
@given(st.one_of(_JSON, _KEYED), st.integers(0, 13))
def test_any_json_matches_its_schema_or_is_one_clear_error(data, which):
    schema = _schemas()[which]
    try:
        assert check_json(data, schema, "f") is data
    except ValueError as exc:
        assert str(exc).startswith("f") and "\n" not in str(exc) and len(str(exc)) < 400, str(exc)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=200) | _JSON.map(lambda v: json.dumps(v).encode()))
def test_any_file_is_read_as_json_or_is_one_clear_error(tmp_path_factory, content):
    from fastprompt.model.checkpoint import CheckpointFile

    path = tmp_path_factory.mktemp("json") / "f.json"
    path.write_bytes(content)
    try:
        read_json(path, "f", schema=CheckpointFile)
    except ValueError as exc:
        assert str(exc).startswith("f") and "\n" not in str(exc), str(exc)
    assert path.read_bytes() == content
