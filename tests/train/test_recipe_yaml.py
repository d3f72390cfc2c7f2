"""Recipes and --set as a hostile or careless user writes them: alias bombs, huge values, deep nesting, keys given
twice, out-of-range seeds. Each ends in one bounded line naming the source, before torch is imported, and nothing
is written."""
import sys
import time
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastprompt.cli import main
from fastprompt.fields import coerce
from fastprompt.messages import MAX_CHARS, shown
from fastprompt.train.config import KEYS, TrainConfig, load_config, parse_overrides
from fastprompt.train.recipe_yaml import MAX_DEPTH, MAX_SCALAR_CHARS, load_yaml

# The 451-byte bomb of the issue: each level holds nine aliases of the one below, 9**5 = 59049 strings.
BOMB = ('a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
        "b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
        "d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\ne: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]\n"
        "f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]\ng: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]\n"
        "seed: [*g,*g,*g,*g,*g,*g,*g,*g,*g]\n")


def _config_error(tmp_path, text: str) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError) as info:
        load_config(path)
    return str(info.value)


def test_an_alias_bomb_is_refused_at_parse_time_in_bounded_memory(tmp_path):
    tracemalloc.start()
    t0 = time.perf_counter()
    message = _config_error(tmp_path, BOMB)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert time.perf_counter() - t0 < 5 and peak < 20 * 2**20, peak  # was 1.6 GB and a MemoryError
    assert "is not valid YAML: line 2, column 8: an alias (*a) is not allowed in a fastprompt config" in message
    assert "\n" not in message and len(message) < 300
    with pytest.raises(ValueError, match=r"--set .*an alias \(\*a\) is not allowed"):
        parse_overrides(["seed=[*a, *a]"])


def test_a_value_in_an_error_message_is_bounded():
    """An 80 MB error line before: what a message quotes is cut (reprlib), whatever was given (the API too)."""
    huge = [["x" * 1000] * 1000] * 1000
    for key, tp in (("seed", int), ("learning_rate", float), ("model", str), ("progress_bar", bool)):
        with pytest.raises(ValueError) as info:
            coerce(key, huge, tp)
        assert len(str(info.value)) < 200, str(info.value)
    with pytest.raises(ValueError) as info:
        TrainConfig(pooler="y" * 10**6)
    assert str(info.value).startswith("pooler must be one of") and len(str(info.value)) < 300
    assert len(shown(10**5000)) <= MAX_CHARS and "5001 digits" in shown(10**5000)


@pytest.mark.parametrize("text,message", [
    ("seed: " + "[" * 1000 + "]" * 1000, f"lists or mappings nested more than {MAX_DEPTH} deep"),
    ("seed: " + "{a: " * 500 + "1" + "}" * 500, f"lists or mappings nested more than {MAX_DEPTH} deep"),
    ("model: " + "x" * (MAX_SCALAR_CHARS + 1), f"a value of {MAX_SCALAR_CHARS + 1} characters; a config value has "
                                                f"at most {MAX_SCALAR_CHARS}"),
    ("seed: 1\nlearning_rate: 0.1\nseed: 2\n", "line 3, column 1: the key 'seed' is given twice (first on line 1)"),
    ("seed: 2024-13-45\n", "is not valid YAML: month must be in 1..12"),
    ("seed: !!python/object/apply:os.system [echo]\n", "could not determine a constructor for the tag"),
])
def test_malformed_recipes_are_one_line(tmp_path, text, message):
    got = _config_error(tmp_path, text)
    assert message in got and "\n" not in got and len(got) < 400, got


def test_a_recipe_over_the_size_limit_is_not_read(tmp_path):
    assert "bytes, more than the 1048576 it may have" in _config_error(tmp_path, "# " + "x" * (1 << 20) + "\n")


def test_set_values_are_checked_like_recipes():
    with pytest.raises(ValueError, match=r"a value of 5000 characters; a config value has at most 4096"):
        parse_overrides(["model=" + "x" * 5000])
    with pytest.raises(ValueError, match=r"the key 'a' is given twice"):
        parse_overrides(["seed={a: 1, a: 2}"])
    with pytest.raises(ValueError, match=f"nested more than {MAX_DEPTH} deep"):
        parse_overrides(["seed=" + "[" * 1000])


@pytest.mark.parametrize("value,message", [
    ("-5", "seed must be in [0, 4294967295], got -5"),
    ("1e23", "seed must be in [0, 4294967295], got 99999999999999991611392"),
    ("4294967296", "seed must be in [0, 4294967295]"),
])
def test_an_out_of_range_seed_fails_at_config_time_and_leaves_nothing(tmp_path, capsys, value, message):
    """seed=1e23 failed after the data loaded, with an overflow naming nothing, leaving a lock and a log."""
    out = tmp_path / "run"
    assert main(["train", "--set", f"seed={value}", "--output-dir", str(out), "--set", "train_file=x.txt"]) == 2
    err = capsys.readouterr().err
    assert f"fastprompt train: error: {message}" in err and "Traceback" not in err, err
    assert not out.exists()
    assert TrainConfig(seed=4294967295).seed == 4294967295


def test_a_temperature_below_the_bound_is_refused_with_the_reason():
    """temperature=1e-30 trained to a loss of -9.4e21 and "completed": float32 rounding of cos/temperature."""
    with pytest.raises(ValueError, match=r"temperature must be >= 0.001, got 1e-30"):
        TrainConfig(temperature=1e-30)
    assert TrainConfig(temperature=1e-3).temperature == 1e-3


def test_recipes_are_read_before_torch_is_imported(tmp_path):
    """The loader stays standard library + PyYAML (the config fails in half a second)."""
    import subprocess

    path = tmp_path / "r.yaml"
    path.write_text(BOMB, encoding="utf-8")
    code = ("import sys\nfrom fastprompt.train.config import load_config\ntry:\n    load_config(sys.argv[1])\n"
            "except ValueError:\n    pass\nassert 'torch' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code, str(path)], check=True, timeout=60)


# ------------------------------------------------------------------ property-based: any text, any --set
_KEY = st.sampled_from(sorted(KEYS) + ["base", "unknown_key", "seed"])
_SCALAR = st.one_of(st.integers(-2**70, 2**70), st.floats(allow_nan=True, allow_infinity=True), st.booleans(),
                    st.none(), st.text(max_size=30), st.sampled_from(["1e23", "-5", ".inf", ".nan", "0x1F", "~",
                                                                       "2024-13-45", "[]", "{}", "*a", "&a 1"]))


def _yaml_value(value) -> str:
    if isinstance(value, str):
        return value if value.strip() and "\n" not in value else repr(value)
    return {None: "null", True: "true", False: "false"}.get(value, str(value)) if not isinstance(value, float) \
        else repr(value)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(_KEY, _SCALAR), max_size=8), st.text(max_size=40))
def test_any_recipe_is_a_config_or_one_clear_error(tmp_path_factory, items, noise):
    """Random key: value lines (with YAML's corner cases) plus random text: a TrainConfig or a ValueError /
    OSError with a bounded one-line message; never another exception, never a hang."""
    text = "".join(f"{k}: {_yaml_value(v)}\n" for k, v in items) + noise
    path = tmp_path_factory.mktemp("recipe") / "r.yaml"
    path.write_text(text, encoding="utf-8")
    try:
        assert isinstance(load_config(path), TrainConfig)
    except (ValueError, OSError) as exc:
        assert str(exc) and len(str(exc)) < 1000, str(exc)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=60), max_size=4))
def test_any_set_is_a_config_or_one_clear_error(items):
    try:
        assert isinstance(load_config(None, items), TrainConfig)
    except (ValueError, OSError) as exc:
        assert str(exc) and len(str(exc)) < 1000, str(exc)


@settings(max_examples=150, deadline=None)
@given(st.recursive(st.one_of(st.text(max_size=10), st.integers(), st.none()),
                    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=5), inner,
                                                                                           max_size=4)),
                    max_leaves=30))
def test_any_nested_structure_is_parsed_or_refused(value):
    """Flow-style YAML of random nesting: loaded (it is valid YAML) or refused for depth, in one line."""
    import json

    text = json.dumps(value, ensure_ascii=False)  # JSON is YAML's flow style (\\u escapes of surrogates are not)
    # ...except that YAML reads NEL, LS and PS as line breaks, which a quoted scalar folds to a space: written as
    # JSON's \\u escapes (valid in YAML's double-quoted scalars too) they stay themselves
    for brk in ("\x85", "\u2028", "\u2029"):
        text = text.replace(brk, f"\\u{ord(brk):04x}")
    try:
        assert load_yaml(text, "test") == value or isinstance(value, dict)  # YAML keeps "1" vs 1 apart too
    except ValueError as exc:  # too deep, a key twice, a character YAML does not allow (\x7f)
        assert str(exc).startswith("test is not valid YAML: ") and "\n" not in str(exc), str(exc)
