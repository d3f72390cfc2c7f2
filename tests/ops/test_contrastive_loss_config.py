"""The contrastive loss's launch configurations and tuning hooks (kernels/contrastive_loss.py, contrastive_chunked.py):
the order in which a config is chosen (the tuner's override, the interpreter's tiles, the GPU's tuned table, the
heuristic default), the candidates ``tune_space`` offers, the column split that keeps every SM busy, the stripe's
row chunks, and ``auto``'s choice between the fused and the chunked variant."""
import pytest
import torch

pytest.importorskip("triton")

from fastprompt.kernels import contrastive_chunked as tc  # noqa: E402
from fastprompt.kernels import contrastive_loss as tk  # noqa: E402
from fastprompt.kernels import tuning  # noqa: E402
from fastprompt.kernels._common import LaunchConfig  # noqa: E402

KEY = tk.shape_key(torch.bfloat16, 4096, 4096, 768)


def test_shape_key_names_the_precision_and_the_sizes():
    assert KEY == {"dtype": "bf16", "d": 768, "n": 4096, "cols_per_row": 1, "dims": 1}
    assert tk.shape_key(torch.float16, 100, 250, 64, ndims=3) == {"dtype": "fp16", "d": 64, "n": 100,
                                                                  "cols_per_row": 3, "dims": 8}
    assert tc.variant_key(torch.bfloat16, 4096, 8192, 768, True) == {"dtype": "bf16", "d": 768, "n": 4096,
                                                                     "grad": True}


def test_config_order_override_interpreter_table_default(monkeypatch):
    entry = tuning.TunedEntry("contrastive_loss", "stats", KEY, {"BLOCK_N": 128, "WAVES": 4, "num_warps": 4})
    monkeypatch.setattr(tuning, "tuned_entry", lambda op, kernel, key, device: entry if kernel == "stats" else None)
    default = tk.config(torch.bfloat16, interpret=False, kernel="stats")
    assert default.tiles == {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 64, "WAVES": 2} and default.num_stages == 3
    tuned = tk.config(torch.bfloat16, interpret=False, kernel="stats", key=KEY, device="cuda")
    assert tuned.tiles == {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "WAVES": 4} and tuned.num_warps == 4
    assert tk.config(torch.bfloat16, interpret=False, kernel="stats", key=KEY, device="cpu") == default
    assert tk.config(torch.bfloat16, interpret=False, kernel="stats", key=KEY, device="cuda", aligned=False) == \
        tk.config("bf16", interpret=False, kernel="stats", aligned=False)  # unaligned strides: the narrow default
    assert tk.config(torch.bfloat16, interpret=True, kernel="stats").tiles["BLOCK_M"] == 16
    mine = LaunchConfig(dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, WAVES=1), num_warps=2)
    with tk.override_configs(stats=mine):
        assert tk.config(torch.bfloat16, interpret=False, kernel="stats", key=KEY, device="cuda") is mine
    assert tk.config(torch.bfloat16, interpret=False, kernel="stats") == default  # restored
    with pytest.raises(ValueError, match="unknown kernels"):
        with tk.override_configs(softmax=mine):
            pass
    with pytest.raises(ValueError, match="unknown kernel"):
        tk.config(torch.bfloat16, kernel="softmax")


@pytest.mark.parametrize("kernel", tk.KERNELS)
@pytest.mark.parametrize("tag", tk.PRECISIONS)
def test_tune_space_offers_distinct_candidates_around_the_default(kernel, tag):
    space = tk.tune_space(kernel, dict(KEY, dtype=tag))
    assert space[0] == tk.config(tag, interpret=False, kernel=kernel) and len(space) > 2
    assert len({repr(c) for c in space}) == len(space)
    for cfg in space:
        assert set(cfg.tiles) == set(space[0].tiles) and cfg.num_warps in (4, 8)


@pytest.mark.parametrize("row_tiles,col_tiles,sms", [(1, 100, 132), (64, 64, 132), (1024, 1024, 132), (3, 2, 132),
                                                     (1, 1, 8)])
def test_column_splits_keep_every_sm_busy(row_tiles, col_tiles, sms):
    splits, per = tk.column_splits(row_tiles, col_tiles, 2, sms)
    assert 1 <= splits <= col_tiles and (splits - 1) * per < col_tiles <= splits * per  # every tile, none empty
    assert row_tiles * splits >= min(2 * sms, row_tiles * col_tiles) * 0.5  # within a split's rounding of 2 waves


def test_chunk_rows_follow_the_stripe_budget():
    cfg = LaunchConfig(dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, STRIPE_KIB=512 << 10), num_warps=8)
    stats = LaunchConfig(dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, WAVES=2), num_warps=8)
    with tk.override_configs(epilogue=cfg, stats=stats):
        assert tc.chunk_rows(65536, 65536, 768, 1, torch.bfloat16, "cpu", "chunked") == 2048  # 512 MiB of fp32
        assert tc.chunk_rows(65536, 65536, 768, 2, torch.bfloat16, "cpu", "chunked") == 1024  # two prefixes
        assert tc.chunk_rows(100, 65536, 768, 1, torch.bfloat16, "cpu", "triton") == 128  # all rows, in row tiles
        assert tc.chunk_rows(100, 3 << 20, 768, 1, torch.bfloat16, "cpu", "triton") == 0  # streams instead
        assert tc.chunk_rows(100, 3 << 20, 768, 1, torch.bfloat16, "cpu", "chunked") == 32  # one tile over budget


def test_auto_variant_chooser_table_and_heuristic(monkeypatch):
    assert tc.choose_variant(torch.bfloat16, 16384, 16384, 768, True, "cpu") == "chunked"
    assert tc.choose_variant(torch.bfloat16, 1024, 1024, 768, True, "cpu") == "triton"
    assert tc.choose_variant(torch.bfloat16, 16384, 16384, 768, False, "cpu") == "triton"  # no stripe: stream
    measured = tuning.BackendChoice("contrastive_loss", {"dtype": "bf16", "d": 768, "n": 1024, "grad": True}, "plain")
    monkeypatch.setattr(tuning, "measured_choice", lambda op, key, device: measured)
    assert tc.choose_variant(torch.bfloat16, 1024, 1024, 768, True, "cuda") == "chunked"  # "plain": chunked
    seen = []
    tc.set_variant_chooser(lambda key: seen.append(key) or "triton")
    try:
        assert tc.choose_variant(torch.bfloat16, 16384, 16384, 768, True, "cuda") == "triton"
        assert seen == [{"dtype": "bf16", "d": 768, "n": 16384, "grad": True}]
    finally:
        tc.set_variant_chooser(None)
