"""fastprompt.train.flops: the one count of a prompted step's matrix work, against a hand count on a tiny config
and against what torch.utils.flop_counter sees in PEFT prefix tuning's forward and backward (an implementation
written independently of the count). Counts are integers: every comparison is exact."""
import pytest
import torch
from transformers import AutoConfig

from fastprompt.train.flops import step_flops


def test_hand_count_on_a_tiny_bert_config():
    cfg = AutoConfig.for_model("bert", hidden_size=8, intermediate_size=12, num_hidden_layers=2,
                               num_attention_heads=2)
    f = step_flops(cfg, 3, 1, rows=2)  # 2 rows of S = 3 tokens, P = 1 prefix key, H = 8, F = 12, L = 2
    # multiply-adds per row and layer: projections 4 S H^2 = 768, feed-forward 2 S H F = 576,
    # attention 2 S (P + S) H = 192
    # forward: 2 rows x 2 layers x (768 + 576 + 192) = 6144 MACs
    assert f.forward == 2 * 6144
    # backward: 2 x (2 x (768 + 576 + 2 x 192) - layer 0's saving); the saving: Q/K/V input gradients 3 S H^2 = 576,
    # dQ S (P + S) H = 96, dK and dV of the token keys 2 S^2 H = 144: 2 x (3456 - 816) = 5280 MACs
    assert f.backward == 2 * 5280
    # the loss: a 1 x 1 similarity over H = 8 (the two views of one sentence), forward and two gradients: 24 MACs
    assert f.loss == 2 * 24
    # attention's products: 2 x (2 layers x 3 x 192 - (96 + 144)) = 1824 MACs
    assert f.attention == 2 * 1824
    assert f.total == 2 * (6144 + 5280 + 24)
    # the same rows given as lengths; training the backbone adds the weight gradients and layer 0's whole backward
    assert step_flops(cfg, [3, 3], 1) == f
    assert step_flops(cfg, 3, 1, rows=2, train_backbone=True).backward == 2 * 2 * 2 * (2 * (768 + 576) + 2 * 192)
    # real tokens: rows of 1 and 3 tokens: 4 H^2 + 2 H F = 448 MACs per token and layer, attention's
    # 2 S (P + S) H per row
    short = step_flops(cfg, [1, 3], 1, similarity=(1, 1))
    assert short.forward == 2 * 2 * ((1 + 3) * (256 + 192) + 2 * (1 * 2 + 3 * 4) * 8)


def test_grouped_query_heads_and_gated_feed_forward():
    cfg = AutoConfig.for_model("llama", hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=4)
    f = step_flops(cfg, 5, 2, rows=1, similarity=(0, 0))
    # S = 5: Q and O 16 x 16, K and V 16 x 8 (2 heads of 4): 5 x 16 x 48 = 3840; gate, up, down: 3 x 5 x 16 x 24 =
    # 5760; attention per query head 2 S (P + S) d = 280, 4 heads: 1120
    assert f.forward == 2 * (3840 + 5760 + 1120)


def test_bad_arguments_are_refused():
    cfg = AutoConfig.for_model("bert", hidden_size=8, intermediate_size=12, num_hidden_layers=1,
                               num_attention_heads=2)
    with pytest.raises(ValueError, match="rows="):
        step_flops(cfg, 3)
    with pytest.raises(ValueError, match="lengths"):
        step_flops(cfg, [3, 4], rows=3)
    with pytest.raises(ValueError, match=">= 0"):
        step_flops(cfg, [3, -1])


def test_count_matches_torch_flop_counter(tiny_bert_dir):
    """The forward and backward of the count against torch.utils.flop_counter on PEFT prefix tuning (eager
    attention so that the counter sees its products; frozen linear layers), dropout off, padded rows and then
    every row alone at its own length (the real-token count). The counter sees every matmul, so matching it, up
    to the terms accounted for below, means the analysis left nothing out and counted no weight gradient. What
    differs, and why: AutoModel also runs BERT's pooler (a dense layer on each [CLS], which the [CLS]-vector loss
    never reads), and autograd computes layer 0's dK and dV of the token keys too (then drops them, as the
    tokens' keys come from frozen weights and inputs); the count leaves both out, as a step need not do them."""
    peft = pytest.importorskip("peft")
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModel

    P = 3
    cfg = AutoConfig.from_pretrained(tiny_bert_dir)
    model = peft.get_peft_model(AutoModel.from_pretrained(tiny_bert_dir, attn_implementation="eager"),
                                peft.PrefixTuningConfig(task_type="FEATURE_EXTRACTION", num_virtual_tokens=P)).eval()
    H = cfg.hidden_size

    def counted(ids):
        with FlopCounterMode(display=False) as fwd:
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids)).last_hidden_state
        with FlopCounterMode(display=False) as bwd:
            out.backward(torch.randn_like(out))
        bmm = sum(n for c in (fwd, bwd) for op, n in c.get_flop_counts()["Global"].items() if "bmm" in str(op))
        return fwd.get_total_flops(), bwd.get_total_flops(), bmm

    def unused(lengths):  # the pooler's forward, layer 0's dK and dV of the token keys (2 S^2 H per row)
        return 2 * len(lengths) * H * H, sum(2 * 2 * s * s * H for s in lengths)

    lengths = [9] * 10  # padded: 5 pairs x 9 tokens
    got = counted(torch.randint(5, cfg.vocab_size, (len(lengths), 9)))
    want, (pooler, layer0) = step_flops(cfg, 9, P, rows=len(lengths)), unused(lengths)
    assert got == (want.forward + pooler, want.backward + layer0, want.attention + layer0)
    lengths = [1, 4, 9]  # real tokens: each row alone at its own length
    got = [sum(x) for x in zip(*(counted(torch.randint(5, cfg.vocab_size, (1, s))) for s in lengths))]
    want, (pooler, layer0) = step_flops(cfg, lengths, P), unused(lengths)
    assert got == [want.forward + pooler, want.backward + layer0, want.attention + layer0]
