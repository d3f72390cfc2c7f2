"""The objectives' registry and builder (fastprompt.objectives.registry): every registered objective by name, built
from a config's keys; the objectives themselves are tested with their methods (tests/methods/<name>/)."""
import pytest
import torch

from fastprompt.methods.promcse.objective import PromCSEEH
from fastprompt.methods.simcse.objective import SimCSE
from fastprompt.objectives import OBJECTIVES, build_objective


def test_registry_and_errors():
    assert set(OBJECTIVES) == {"simcse", "promcse_eh", "skicse"}
    obj = build_objective("promcse_eh", temperature=0.1, backend="reference")
    assert isinstance(obj, PromCSEEH) and obj.temperature == 0.1 and obj.hinge_weight == 10.0
    with pytest.raises(ValueError, match="objective promcse_eh takes no learning_rate"):
        build_objective("promcse_eh", temperature=0.1, learning_rate=3.0)  # would set nothing
    with pytest.raises(ValueError, match="unknown objective 'infonce'"):
        build_objective("infonce")
    with pytest.raises(ValueError, match="hinge_weight > 0"):
        PromCSEEH(hinge_weight=0.0)
    with pytest.raises(ValueError, match="k >= 0 negatives"):
        SimCSE()(torch.randn(4, 3, 8))
    with pytest.raises(ValueError, match="no in-batch negative"):
        SimCSE()(torch.randn(2, 1, 8))
    nan = torch.randn(2, 3, 4)
    nan[0, 0, 0] = float("nan")
    assert not torch.isfinite(SimCSE()(nan).loss)  # reported as a non-finite loss, not an exception


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_an_objective_built_without_a_config_has_the_configs_defaults(name):
    """The classes take their defaults from the config: SimCSE() is what a default config builds (SKICSE's from its
    own section too)."""
    import dataclasses

    from fastprompt.methods import objective_sections
    from fastprompt.objectives import objective_from_config
    from fastprompt.train import TrainConfig

    cfg = TrainConfig(objective=name)
    assert build_objective(name) == objective_from_config(cfg.loss, objective_sections(cfg))
    assert all(f.default is not dataclasses.MISSING for f in dataclasses.fields(OBJECTIVES[name]))


def test_config_keys_the_objective_does_not_read_are_refused():
    """objective_from_config passes each objective the keys its fields are named after; a key set away from its
    default that the chosen objective ignores would otherwise change nothing, silently."""
    from fastprompt.methods import objective_sections
    from fastprompt.objectives import ObjectiveConfig, objective_from_config
    from fastprompt.train import TrainConfig

    cfg = TrainConfig(objective="simcse", ski_weight=0.3)  # SKICSE's key, in its method's own section
    assert cfg.ski.ski_weight == 0.3 and not hasattr(cfg.loss, "ski_weight")
    with pytest.raises(ValueError, match=r"objective simcse does not use ski_weight=0.3"):
        objective_from_config(cfg.loss, objective_sections(cfg))
    with pytest.raises(ValueError, match=r"objective skicse does not use hinge_margin=0.5"):
        objective_from_config(ObjectiveConfig(name="skicse", hinge_margin=0.5))
    obj = objective_from_config(ObjectiveConfig(name="promcse_eh", hinge_margin=0.5, loss_backend="reference"))
    assert (obj.hinge_margin, obj.hinge_weight, obj.backend) == (0.5, 10.0, "reference")


def test_register_objective_refuses_bad_names_and_duplicates():
    from fastprompt.objectives import register_objective

    with pytest.raises(ValueError, match="already registered"):
        register_objective("simcse", SimCSE)
    with pytest.raises(ValueError, match="identifier"):
        register_objective("my-loss", SimCSE)
    with pytest.raises(ValueError, match="'module:Class'"):
        register_objective("mine", "fastprompt.methods.simcse.objective.SimCSE")
