"""Tuned kernel configurations shipped as data (fastprompt.kernels.tuning): the file format, the search order (the
user's folder, then the package's; this Triton version, then another), the nearest-shape lookup, the reach of a
measured backend choice, and the fallbacks (no file, an unreadable file), each logged."""
import json
import logging

import pytest
from fastprompt.kernels import tuning
from fastprompt.kernels.tuning import BackendChoice, TunedEntry, TunedTable

KEY = {"dtype": "bf16", "D": 64, "S": 128, "P": 16, "dropout": False}


@pytest.fixture(autouse=True)
def _user_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTPROMPT_TUNING_DIR", str(tmp_path / "user"))
    tuning.table_for.cache_clear()
    yield tmp_path / "user"
    tuning.table_for.cache_clear()


def _table(device="NVIDIA Test GPU", triton="3.7.1", **kw) -> TunedTable:
    t = TunedTable(device, triton, source="test")
    for S, m in ((32, 32), (128, 64), (512, 128)):
        t.add_entry(TunedEntry("prefix_attention", "fwd", dict(KEY, S=S), {"BLOCK_M": m, "BLOCK_N": 64,
                                                                          "num_warps": 4, "num_stages": 3}, 0.1))
    t.add_entry(TunedEntry("prefix_attention", "fwd", dict(KEY, S=128, dropout=True), {"BLOCK_M": 16, "num_warps": 8}))
    t.add_choice(BackendChoice("prefix_attention", dict(KEY, S=32), "plain", {"triton": 2.0, "plain": 1.0}))
    return t


def _write(folder, table: TunedTable):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / tuning.file_name(table.device, table.triton)
    path.write_text(json.dumps(table.to_dict()))
    return path


def test_nearest_shape_lookup_matches_flags_exactly_and_sizes_by_log_distance():
    t = _table()
    assert t.entry("prefix_attention", "fwd", dict(KEY, S=100)).config["BLOCK_M"] == 64  # 128 is nearest in log2
    assert t.entry("prefix_attention", "fwd", dict(KEY, S=40)).config["BLOCK_M"] == 32
    assert t.entry("prefix_attention", "fwd", dict(KEY, S=4096)).config["BLOCK_M"] == 128
    assert t.entry("prefix_attention", "fwd", dict(KEY, dropout=True)).config["BLOCK_M"] == 16  # the flag decides
    assert t.entry("prefix_attention", "fwd", dict(KEY, dtype="fp16")) is None  # no entry of that dtype
    assert t.entry("prefix_attention", "bwd", KEY) is None and t.entry("contrastive_loss", "fwd", KEY) is None
    assert t.entry("prefix_attention", "fwd", {"dtype": "bf16", "D": 64}) is None  # other key names: incomparable
    e = t.entry("prefix_attention", "fwd", KEY)
    assert e.tiles() == {"BLOCK_M": 64, "BLOCK_N": 64} and e.options() == {"num_warps": 4, "num_stages": 3}


def test_a_measured_choice_reaches_only_nearby_shapes():
    t = _table()
    assert t.choice("prefix_attention", dict(KEY, S=32)).backend == "plain"
    assert t.choice("prefix_attention", dict(KEY, S=64)).backend == "plain"  # one octave away
    assert t.choice("prefix_attention", dict(KEY, S=256)) is None  # three octaves: not measured there
    assert t.choice("prefix_attention", dict(KEY, S=32, dtype="fp32")) is None


def test_round_trip_and_replacing_an_entry():
    t = _table()
    again = TunedTable.from_dict(json.loads(json.dumps(t.to_dict())))
    assert again.entries == t.entries and again.choices == t.choices
    t.add_entry(TunedEntry("prefix_attention", "fwd", dict(KEY, S=32), {"BLOCK_M": 128}))
    assert len(t.entries) == 4 and t.entry("prefix_attention", "fwd", dict(KEY, S=32)).config == {"BLOCK_M": 128}


def test_search_order_user_folder_then_package_and_this_triton_version_first(_user_dir, tmp_path, monkeypatch,
                                                                             caplog):
    package = tmp_path / "package"
    monkeypatch.setattr(tuning, "PACKAGE_DIR", package)
    _write(package, _table(triton="3.7.1"))
    path, exact = tuning.find_table_file("NVIDIA Test GPU", "3.7.1")
    assert path.parent == package and exact
    _write(_user_dir, _table(triton="3.7.1"))
    assert tuning.find_table_file("NVIDIA Test GPU", "3.7.1")[0].parent == _user_dir  # the user's tune wins
    # another Triton version: the newest file of the device, logged
    older, newer = _table(device="NVIDIA Other", triton="3.4.0"), _table(device="NVIDIA Other", triton="3.10.0")
    _write(package, older)
    _write(package, newer)
    with caplog.at_level(logging.INFO, logger="fastprompt.kernels.tuning"):
        table = tuning.table_for("NVIDIA Other", "3.7.1")
    assert table.triton == "3.10.0" and "another compiler" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fastprompt.kernels.tuning"):
        assert tuning.table_for("NVIDIA Unmeasured", "3.7.1") is None
    assert "heuristic defaults" in caplog.text and "fastprompt tune" in caplog.text


def test_an_unreadable_table_is_skipped_with_a_warning_naming_it(_user_dir, caplog):
    _user_dir.mkdir(parents=True)
    bad = _user_dir / tuning.file_name("NVIDIA Broken", "3.7.1")
    bad.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="fastprompt.kernels.tuning"):
        assert tuning.table_for("NVIDIA Broken", "3.7.1") is None
    assert str(bad) in caplog.text and "heuristic defaults" in caplog.text


@pytest.mark.parametrize("data,message", [
    ({"format": 2, "device": "x", "triton": "3"}, "format 1"),
    ({"format": 1, "device": "", "triton": "3"}, "'device' must be"),
    ({"format": 1, "device": "x", "triton": "3", "entries": [{"op": "a", "kernel": "b", "key": {"S": 32},
                                                            "config": {"BLOCK_M": "64"}}]}, "positive integers"),
    ({"format": 1, "device": "x", "triton": "3", "entries": [{"op": "a", "kernel": "b", "key": {"S": -1},
                                                            "config": {"BLOCK_M": 64}}]}, "positive number"),
    ({"format": 1, "device": "x", "triton": "3", "choices": [{"op": "a", "key": {"S": 1}, "backend": "cpu"}]},
     "backend"),
])
def test_a_malformed_table_is_a_clear_error(tmp_path, data, message):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message) as info:
        TunedTable.load(path)
    assert str(path) in str(info.value)


def test_file_names_and_the_shipped_tables_load():
    assert tuning.file_name("NVIDIA H100 80GB HBM3", "3.7.1") == "device_name=NVIDIA_H100_80GB_HBM3,triton=3.7.1.json"
    shipped = sorted(tuning.PACKAGE_DIR.glob("*.json"))
    assert shipped, "the package ships the tuned table of at least the measured GPU (H200)"
    for path in shipped:
        table = TunedTable.load(path)
        assert path.name == tuning.file_name(table.device, table.triton) and table.source
    assert any(TunedTable.load(p).device == "NVIDIA H200" for p in shipped)


def test_no_table_off_a_gpu():
    import torch

    assert tuning.device_name(torch.device("cpu")) is None
    assert tuning.tuned_entry("prefix_attention", "fwd", KEY, "cpu") is None
    assert tuning.measured_choice("prefix_attention", KEY, "cpu") is None
