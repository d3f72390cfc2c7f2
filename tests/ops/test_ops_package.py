"""fastprompt.ops: the documented import paths, and no public function shadowing the module it lives in."""
import types

import fastprompt.ops
from fastprompt.ops import ContrastiveStats, attention, contrastive, contrastive_loss, draw_seed, prefix_attention


def test_functions_and_modules_have_distinct_names():
    assert isinstance(contrastive, types.ModuleType) and isinstance(attention, types.ModuleType)
    assert contrastive_loss is contrastive.contrastive_loss and prefix_attention is attention.prefix_attention
    assert ContrastiveStats is contrastive.ContrastiveStats and draw_seed is attention.draw_seed
    for name in fastprompt.ops.__all__:
        assert not isinstance(getattr(fastprompt.ops, name), types.ModuleType), name
    import fastprompt.ops.contrastive as by_path  # a plain import statement reaches the module

    assert by_path is contrastive
