"""The toy architecture's family, written by following docs/architectures.md's "Adding an architecture": one
module, one registration line. Its attention goes through transformers' attention functions (so the prefix needs no
adapter), its ``ToyOutput`` modules are dense -> dropout -> LayerNorm(h + input) (the fused op in training, pinned
as read from ``Upstream(...).current()``), and its packed forward is tested equal to the padded one
(tests/train/test_add_architecture.py)."""
from fastprompt.model.arch import Family, Upstream, register_family

OUTPUT = Upstream("toy_arch.model", "ToyOutput", "(self, hidden_states: 'torch.Tensor', input_tensor: "
                  "'torch.Tensor') -> 'torch.Tensor'", "0650f56bc438ef17")

register_family(Family("fastprompt-toy", "Toy encoders", add_norm=(OUTPUT,), packs=True))
