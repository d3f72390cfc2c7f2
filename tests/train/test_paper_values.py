"""Every paper recipe resolves to the papers' values, as transcribed once in paper_values.yaml.

paper_values.yaml holds, per recipe, each value with its kind: stated by the paper (with a quote), the authors'
code, a library default, or this project's choice; and the recipes' deviations from their papers. Here: every
paper recipe in configs/ is in it and resolves to it key by key (:func:`mismatches`); changing any single value
makes that comparison fail (the negative control, over every value of every recipe); the pins of
recipe_values.json agree with it; each deviation names existing recipes and keys; the recipes' header blocks and
docs/paper-recipes.md are what scripts/paper_recipes.py writes from it; no recipe says UNVERIFIED. That the
quotes are the papers' and hold their values is test_paper_quotes.py's.
"""
import importlib.util
import json
import re
from pathlib import Path

import pytest

from fastprompt.train import load_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
_spec = importlib.util.spec_from_file_location("paper_recipes", ROOT / "scripts" / "paper_recipes.py")
script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(script)
DATA = script.load()
RECIPES = DATA["recipes"]
PINNED = json.loads((Path(__file__).with_name("recipe_values.json")).read_text(encoding="utf-8"))
#: the recipes sized for a 2-core CPU (fastprompt's own settings on all-MiniLM-L6-v2, docs/results-minilm.md)
CPU_RECIPES = ("quickstart.yaml", "quickstart-unsup.yaml")
#: recipes for models no paper trained (this project's sizing for a CPU): not in the papers' table
PROJECT_MODELS = ("minilm", "mpnet", "smollm2")


def mismatches(values: dict, resolved: dict) -> list[str]:
    """The keys whose resolved value is not the value the table gives (type-strict for booleans)."""
    bad = []
    for key, v in values.items():
        got, want = resolved.get(key, "<missing>"), v["value"]
        if got != want or isinstance(got, bool) != isinstance(want, bool):
            bad.append(key)
    return bad


@pytest.fixture(scope="module")
def resolved():
    return {name: load_config(CONFIGS / name).to_dict() for name in RECIPES}


def test_every_paper_recipe_is_in_the_table():
    paper = {p.name for p in CONFIGS.glob("*.yaml")
             if not any(m in p.name for m in PROJECT_MODELS) and p.name not in CPU_RECIPES}
    assert sorted(paper) == sorted(RECIPES)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_resolves_to_the_papers_values(name, resolved):
    entry = RECIPES[name]
    assert entry["paper"] in DATA["papers"]
    assert mismatches(entry["values"], resolved[name]) == [], name
    for key, v in entry["values"].items():
        assert v["kind"] in script.KINDS and v["text"].strip(), f"{name}: {key} has no kind or source"
    rep = entry["reported"]
    if rep is not None:  # the paper's table: seven tasks and their average, as printed (two decimals)
        assert set(rep) == {"source", *script.TASKS}
        # A transcription check. Rounding each score to two decimals keeps the mean of the printed scores within
        # 0.01 of the printed average, but two printed averages are off by more (0.014: DCPCSE Table 1,
        # supervised BERT-base; 0.017: PromptBERT Table 6, unsupervised BERT, a mean over 10 seeds). So this
        # catches gross slips (a wrong integer digit: 1/7 = 0.14 on the mean; another row's average), not a
        # slip in the decimals of one task.
        assert abs(sum(rep[t] for t in script.TASKS[:-1]) / 7 - rep["avg"]) < 0.02, name
    assert entry["seeds"] >= 1


def _changed(value):
    """A different value of the same kind."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value * 2 + 1
    if value is None:
        return "x"
    return value + "-x"


def test_changing_any_single_value_fails_the_comparison(resolved):
    """The negative control: for every value of every recipe, the resolved config with that one value changed is
    caught, and only at that key."""
    checked = 0
    for name, entry in RECIPES.items():
        for key in entry["values"]:
            edited = dict(resolved[name], **{key: _changed(resolved[name][key])})
            assert mismatches(entry["values"], edited) == [key], (name, key)
            checked += 1
    assert checked == sum(len(e["values"]) for e in RECIPES.values()) > 600


def test_an_edited_recipe_file_fails_the_comparison(tmp_path, resolved):
    """The same through a real file: a copy of a recipe with one line changed (D2CSE's Table 7 learning rate)."""
    import shutil

    name = "d2cse-unsup-bert-base.yaml"
    text = (CONFIGS / name).read_text(encoding="utf-8")
    assert "\nlearning_rate: 0.021\n" in text
    shutil.copytree(CONFIGS / "base", tmp_path / "base")  # the recipe's base: chain, at the same relative path
    (tmp_path / name).write_text(text, encoding="utf-8")
    assert mismatches(RECIPES[name]["values"], load_config(tmp_path / name).to_dict()) == []
    (tmp_path / name).write_text(text.replace("\nlearning_rate: 0.021\n", "\nlearning_rate: 0.021001\n"),
                                 encoding="utf-8")
    assert mismatches(RECIPES[name]["values"], load_config(tmp_path / name).to_dict()) == ["learning_rate"]


def test_the_pinned_values_agree_with_the_table():
    """recipe_values.json pins every resolved key; on the keys the papers set, it holds the papers' values."""
    for name, entry in RECIPES.items():
        assert mismatches(entry["values"], PINNED[name]) == [], name


def test_every_deviation_names_existing_recipes_and_keys():
    assert len(DATA["deviations"]) >= 5
    for d in DATA["deviations"]:
        for name in d["recipes"]:
            assert set(d["keys"]) <= set(RECIPES[name]["values"]), (name, d["keys"])
        assert d["paper"].strip() and d["recipe"].strip() and d["why"].strip()


def test_the_generated_headers_and_docs_page_are_current():
    assert script.stale(DATA) == [], "run scripts/paper_recipes.py"
    for name, entry in RECIPES.items():
        text = (CONFIGS / name).read_text(encoding="utf-8")
        assert script.header_block(name, entry, DATA) in text
        for key in entry["values"]:  # each value is cited in the recipe's header
            assert f"#   {key}: " in text, (name, key)
    for path in [*CONFIGS.glob("*.yaml"), *CONFIGS.glob("base/*.yaml")]:
        assert "UNVERIFIED" not in path.read_text(encoding="utf-8"), path.name


def test_the_docs_page_lists_each_recipe_with_its_command_and_number():
    doc = (ROOT / "docs" / "paper-recipes.md").read_text(encoding="utf-8")
    for name, entry in RECIPES.items():
        assert script.command(name, entry) in doc
        if entry["reported"] is not None:
            assert f"{entry['reported']['avg']:.2f}" in doc
    assert "--seeds 1,2,3,4,5,6,7,8,9,10" in script.command("dcpcse-unsup-bert-base.yaml",
                                                           RECIPES["dcpcse-unsup-bert-base.yaml"])


@pytest.mark.parametrize(("value", "message"), [
    ('[256, "DCPCSE Table 4"]', "write {value: V, paper|code|default|choice: ...}"),
    ('{value: 256, code: "x", default: "y"}', "exactly one kind"),
    ('{value: 256, paper: "Batch size 256"}', "says where it is"),
    ('{value: 256, code: "x", column: 1}', "not allowed with code"),
    ('{value: 256, choice: ""}', "choice needs its text"),
    ('{value: 256, paper: "Batch size 256", at: "Table 4", in: SimCSE}', "has no text in ../shared/papers"),
])
def test_the_script_refuses_a_malformed_value(tmp_path, value, message):
    bad = tmp_path / "values.yaml"
    bad.write_text("papers: {DCPCSE: {text: dcpcse.txt, ref: r}, SimCSE: {text: null, ref: r}}\nrecipes:\n"
                   f"  x.yaml:\n    paper: DCPCSE\n    values:\n      batch_size: {value}\n", encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape(message)):
        script.load(bad)
