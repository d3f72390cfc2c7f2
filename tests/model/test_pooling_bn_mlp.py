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
    # init_std 0.5: the last BatchNorm's input then has a batch variance ~2, so BatchNorm's eps (1e-5) moves
    # the output variance by ~5e-6 (with 0.02 weights at this tiny width the variance would be ~3e-3 and eps
    # would move it by ~3e-3)
    pooler = Pooler("bn_mlp", 8, mlp="train", init_std=0.5).train()
    out = pooler.apply_head(torch.randn(32, 8) * 3 + 1)
    torch.testing.assert_close(out.mean(0), torch.zeros(8), atol=1e-5, rtol=0)
    # batch variance (biased, as BatchNorm normalises with it) is 1 up to BatchNorm's eps = 1e-5
    torch.testing.assert_close(out.var(0, unbiased=False), torch.ones(8), atol=1e-3, rtol=0)


def test_heads_start_as_hugging_face_initialises_them():
    """N(0, init_std) weights and zero biases, as SimCSE/DCPCSE/PromCSE/PromptBERT/DiffCSE get from init_weights()
    (PyTorch's default would be uniform with std 1 / sqrt(3 * fan_in) = 0.036 at fan_in 256). Sample std of 65,536
    (Linear+Tanh) or 131,072 (bn_mlp) draws: standard error 0.02 / sqrt(2n) < 6e-5, so 1e-3 is > 15 errors."""
    torch.manual_seed(0)
    for pooler in ("cls", "mean", "mask", "bn_mlp"):
        head = Pooler(pooler, 256, mlp="train", init_std=0.02).head
        linears = [m for m in head if isinstance(m, nn.Linear)]
        assert linears
        for lin in linears:
            assert abs(float(lin.weight.std()) - 0.02) < 1e-3 and abs(float(lin.weight.mean())) < 1e-3
            assert lin.bias is None or not lin.bias.any()


def test_encoder_heads_use_the_backbones_initializer_range(tiny_bert_dir):
    """The encoder's head std is the backbone config's initializer_range (0.02 saved; set to 0.5 here)."""
    from transformers import AutoModel, AutoTokenizer

    from fastprompt.model import PromptConfig, PromptEncoder

    backbone = AutoModel.from_pretrained(tiny_bert_dir)
    backbone.config.initializer_range = 0.5
    enc = PromptEncoder(backbone, AutoTokenizer.from_pretrained(tiny_bert_dir), PromptConfig(prompt_length=2),
                        pooler="cls", mlp="train")
    w = enc.pooler.head[0].weight
    # 32 x 32 = 1,024 draws: standard error of the sample std 0.5 / sqrt(2048) = 0.011; 0.1 is > 9 of them
    assert abs(float(w.std()) - 0.5) < 0.1 and not enc.pooler.head[0].bias.any()
