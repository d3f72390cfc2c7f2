"""fastprompt.fields: the bounds of a config field, as checked and as documented (one rule, one wording)."""
import re
from dataclasses import dataclass, fields

import pytest

from fastprompt.fields import check_bounds, describe_rule, option, validate_fields


@pytest.mark.parametrize("bounds,good,bad,message", [
    (dict(ge=0.0), [0.0, 5.0], [-0.1], "x must be >= 0, got -0.1"),
    (dict(gt=0.0), [1e-9], [0.0], "x must be > 0, got 0.0"),
    (dict(le=1.0), [1.0, -3.0], [1.5], "x must be <= 1, got 1.5"),
    (dict(lt=1.0), [0.99], [1.0], "x must be < 1, got 1.0"),
    (dict(ge=0.0, lt=1.0), [0.0, 0.5], [1.0, -1.0], "x must be in [0, 1), got"),
    (dict(ge=0.0, le=1.0), [0.0, 1.0], [1.01, -0.01], "x must be in [0, 1], got"),
    (dict(gt=0.0, le=1.0), [1.0, 0.3], [0.0, 1.5], "x must be in (0, 1], got"),
    (dict(gt=0.0, lt=1.0), [0.5], [0.0], "x must be > 0, got 0.0"),  # open on both sides: one bound at a time
    (dict(gt=0.0, lt=1.0), [0.5], [1.0], "x must be < 1, got 1.0"),
])
def test_bounds(bounds, good, bad, message):
    for value in good:
        check_bounds("x", value, **bounds)
    for value in bad:
        with pytest.raises(ValueError, match=re.escape(message)):
            check_bounds("x", value, **bounds)


def test_a_field_is_checked_and_documented_with_the_same_bounds():
    @dataclass
    class Section:
        rate: float = option(0.5, "a decay rate", gt=0.0, le=1.0)

        def __post_init__(self):
            validate_fields(self)

    assert describe_rule(fields(Section)[0]) == "> 0, <= 1"
    assert Section(1.0).rate == 1.0 and Section("0.25").rate == 0.25
    with pytest.raises(ValueError, match=r"rate must be in \(0, 1\], got 1.5"):
        Section(1.5)


def test_one_bound_per_side():
    with pytest.raises(ValueError, match="at most one lower bound"):
        option(1.0, "help", ge=0.0, gt=0.0)
    with pytest.raises(ValueError, match="one upper bound"):
        option(1.0, "help", le=1.0, lt=1.0)


def test_the_decay_rates_use_the_upper_bound():
    from fastprompt.train import TrainConfig

    for key in ("mlm_decay_rate", "rtd_decay_rate"):
        assert getattr(TrainConfig(**{key: 1.0}), key) == 1.0
        with pytest.raises(ValueError, match=rf"{key} must be in \(0, 1\], got 1.5"):
            TrainConfig(**{key: 1.5})
        with pytest.raises(ValueError, match=rf"{key} must be in \(0, 1\], got 0.0"):
            TrainConfig(**{key: 0})


def test_list_fields_take_yaml_lists_or_comma_separated_text_with_per_item_rules():
    from fastprompt.fields import MAX_LIST_ITEMS, type_name

    @dataclass
    class Dims:
        dims: list[int] | None = option(None, "dimensions", ge=1)

    d = Dims(dims="384, 128,64")
    validate_fields(d)
    assert d.dims == [384, 128, 64]
    d.dims = [32.0, "8"]
    validate_fields(d)
    assert d.dims == [32, 8]
    for bad, message in (([0], r"dims\[0\] must be >= 1|dims must be >= 1"), ([1.5], r"dims\[0\] must be an integer"),
                         (3, "dims must be a list"), (list(range(1, MAX_LIST_ITEMS + 2)), "at most")):
        d.dims = bad
        with pytest.raises(ValueError, match=message):
            validate_fields(d)
    assert type_name(fields(Dims)[0].type if not isinstance(fields(Dims)[0].type, str) else list[int] | None) == \
        "list[int] | null"
