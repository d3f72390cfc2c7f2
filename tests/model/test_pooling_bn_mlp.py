"""The bn_mlp head is DiffCSE's ProjectionMLP (diffcse/models.py in voidism/DiffCSE), which D2CSE uses:

    Linear(H, 2H, bias=False), BatchNorm1d(2H), ReLU, Linear(2H, H, bias=False), BatchNorm1d(H, affine=False)
"""
import torch
from torch import nn

from fastprompt.model.pooling import Pooler


def test_bn_mlp_head_is_diffcse_projection_mlp():
    head = Pooler("bn_mlp", 8, mlp="train").head
    kinds = [type(m) for m in head]
    assert kinds == [nn.Linear, nn.BatchNorm1d, nn.ReLU, nn.Linear, nn.BatchNorm1d]
    assert (head[0].in_features, head[0].out_features, head[0].bias) == (8, 16, None)
    assert head[1].num_features == 16 and head[1].affine
    assert (head[3].in_features, head[3].out_features, head[3].bias) == (16, 8, None)
    assert head[4].num_features == 8 and not head[4].affine
    names = {n for n, _ in head.named_parameters()}
    assert names == {"0.weight", "1.weight", "1.bias", "3.weight"}


def test_bn_mlp_output_is_batch_normalised_per_dimension():
    torch.manual_seed(0)
    pooler = Pooler("bn_mlp", 8, mlp="train").train()
    out = pooler.apply_head(torch.randn(32, 8) * 3 + 1)
    torch.testing.assert_close(out.mean(0), torch.zeros(8), atol=1e-5, rtol=0)
    # batch variance (biased, as BatchNorm normalises with it) is 1 up to BatchNorm's eps = 1e-5
    torch.testing.assert_close(out.var(0, unbiased=False), torch.ones(8), atol=1e-3, rtol=0)
