"""Every recipe in configs/ resolves to the values pinned in recipe_values.json.

The snapshot was written from the flat recipes before they were rewritten as ``base:`` chains, so the
rewrite (and any later change to a base file or a default) cannot silently change a paper setting. A key
added to TrainConfig later is not in the snapshot and is not checked here; every pinned key is.
"""
import json
from pathlib import Path

import pytest

from fastprompt.train import load_config

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
PINNED = json.loads((Path(__file__).with_name("recipe_values.json")).read_text(encoding="utf-8"))


def test_every_recipe_is_pinned():
    assert sorted(p.name for p in CONFIG_DIR.glob("*.yaml")) == sorted(PINNED)


@pytest.mark.parametrize("name", sorted(PINNED))
def test_recipe_resolves_to_its_pinned_values(name):
    resolved = load_config(CONFIG_DIR / name).to_dict()
    expected = PINNED[name]
    assert set(expected) <= set(resolved), f"keys no longer resolved: {sorted(set(expected) - set(resolved))}"
    diffs = {k: (expected[k], resolved[k]) for k in expected if resolved[k] != expected[k]}
    assert not diffs, f"{name}: (pinned, now) = {diffs}"


def test_pin_script_rewrites_only_the_named_entries(tmp_path):
    """scripts/pin_recipes.py is how entries are written: re-pinning an unchanged recipe changes nothing."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("pin_recipes", CONFIG_DIR.parent / "scripts" / "pin_recipes.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    pins = tmp_path / "recipe_values.json"
    original = (Path(__file__).with_name("recipe_values.json")).read_text(encoding="utf-8")
    pins.write_text(original, encoding="utf-8")
    names = sorted(CONFIG_DIR.glob("d2cse-*.yaml"))
    assert script.main([str(p) for p in names], pins) == 0
    first = json.loads(pins.read_text(encoding="utf-8"))
    before = json.loads(original)
    # other entries stay as they were; a named entry keeps every pinned value (keys added to TrainConfig since
    # the committed pin, such as frozen_cache, may join it)
    assert {k: v for k, v in first.items() if not k.startswith("d2cse-")} == {
        k: v for k, v in before.items() if not k.startswith("d2cse-")}
    for p in names:
        assert before[p.name].items() <= first[p.name].items()
    pinned_once = pins.read_text(encoding="utf-8")
    assert script.main([str(p) for p in names], pins) == 0
    assert pins.read_text(encoding="utf-8") == pinned_once
    edited = json.loads(pinned_once)
    edited["d2cse-unsup-minilm.yaml"]["epochs"] = 99.0
    pins.write_text(json.dumps(edited, indent=1) + "\n", encoding="utf-8")
    assert script.main([str(CONFIG_DIR / "d2cse-unsup-minilm.yaml")], pins) == 0
    assert pins.read_text(encoding="utf-8") == pinned_once
    assert script.main([], pins) == 2
