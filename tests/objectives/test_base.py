"""The objective contract's building blocks: weight schedules, views by name, methods and their extras."""
import pytest
import torch
from safetensors.torch import save_file

from fastprompt.data import Batch
from fastprompt.methods.simcse.objective import SimCSE
from fastprompt.objectives import Method, TokenTerm, Views, WeightSchedule


def test_dcpcse_mlm_weight_schedule_at_steps_0_100_1000():
    w = WeightSchedule(0.1, 0.95, 100)  # DCPCSE: 0.1 * 0.95 ** (step / 100)
    assert w(0) == pytest.approx(0.1, rel=1e-12)
    assert w(100) == pytest.approx(0.095, rel=1e-12)
    assert w(1000) == pytest.approx(0.1 * 0.5987369392383787, rel=1e-12)  # 0.95 ** 10
    assert w(50) == pytest.approx(0.1 * 0.95 ** 0.5, rel=1e-12)  # decays every step, not in stairs
    assert WeightSchedule(0.005)(0) == WeightSchedule(0.005)(10 ** 6) == 0.005  # constant (D2CSE's lambda)


@pytest.mark.parametrize("args,message", [((-0.1,), "weight must be >= 0"), ((0.1, 0.0), "decay_rate"),
                                          ((0.1, 1.5), "decay_rate"), ((0.1, 0.9, 0), "decay_steps")])
def test_bad_weight_schedules(args, message):
    with pytest.raises(ValueError, match=message):
        WeightSchedule(*args)


def test_views_by_name_and_gathered_columns():
    local = torch.randn(3, 2, 4)
    gathered = torch.cat([torch.randn(3, 2, 4), local], dim=1)
    views = Views(("sent0", "sent1", "hard_neg"), local, gathered, positive_offset=2)
    assert views.index("hard_neg") == 2
    with pytest.raises(KeyError, match="no view named 'ski'"):
        views.index("ski")
    with pytest.raises(ValueError, match="view names"):
        Views(("sent0", "sent0"), local, gathered)
    single = Views.single(torch.randn(2, 5, 4))
    assert single.names == ("sent0", "sent1") and single.local is single.gathered


def test_simcse_reads_the_hard_negative_view_by_name():
    torch.manual_seed(0)
    emb = torch.randn(3, 4, 8, dtype=torch.float64)
    named = SimCSE(backend="reference")(Views.single(emb, ("sent0", "sent1", "hard_neg")))
    assert torch.equal(named.loss, SimCSE(backend="reference")(emb).loss)
    with pytest.raises(ValueError, match="k >= 0 negatives.*'ski'"):
        SimCSE()(Views.single(emb, ("sent0", "sent0", "ski")))  # SKICSE's views need SKICSE's objective
    assert SimCSE().views_for(("sent0",)) == ("sent0", "sent0")
    assert SimCSE().views_for(("sent0", "sent1", "hard_neg")) == ("sent0", "sent1", "hard_neg")


class _Count(TokenTerm):
    """A term that marks the first real token of each row."""

    def __init__(self, name="count"):
        super().__init__(name, WeightSchedule(1.0))

    def make_extras(self, batch, generator):
        labels = torch.full_like(batch.input_ids, -100)
        labels[:, 0] = batch.input_ids[:, 0]
        return {f"{self.name}_labels": labels}

    def num_targets(self, extras):
        return (extras[f"{self.name}_labels"] != -100).sum()


def _batch():
    ids = torch.tensor([[2, 5, 6, 0], [2, 7, 0, 0], [2, 5, 6, 0], [2, 7, 0, 0]])
    return Batch(ids, (ids != 0).long(), None, n_views=2, batch_size=2, view_names=("sent0", "sent0"))


def test_method_extras_and_log_columns():
    method = Method(SimCSE(hinge_weight=1.0), [_Count("a"), _Count("b")])
    batch = method.add_extras(_batch(), {"a": torch.Generator(), "b": torch.Generator()})
    assert set(batch.extras) == {"a_labels", "b_labels"} and batch.extras["a_labels"].shape == (4, 4)
    assert method.log_columns() == ("pos_cos", "hard_neg_cos", "acc", "loss_cl", "loss_eh", "loss_sentence",
                                    "loss_a", "w_a", "loss_b", "w_b")
    assert Method(SimCSE()).log_columns() == ("pos_cos", "hard_neg_cos", "acc")
    with pytest.raises(ValueError, match="distinct names"):
        Method(SimCSE(), [_Count(), _Count()])
    with pytest.raises(ValueError, match="identifier"):
        _Count("loss-mlm")


def test_extras_are_token_aligned_and_unique():
    batch = _batch()
    with pytest.raises(ValueError, match="token-aligned"):
        Batch(batch.input_ids, batch.attention_mask, None, 2, 2, extras={"x": torch.zeros(4)})
    twice = Method(SimCSE(), [_Count("a")])
    twice.add_extras(batch, {"a": torch.Generator()})
    with pytest.raises(ValueError, match="already made"):
        twice.add_extras(batch, {"a": torch.Generator()})
    moved = batch.to("cpu")
    assert moved.view_names == ("sent0", "sent0") and set(moved.extras) == {"a_labels"}


class _WithFrozenHead(_Count):
    """A term holding a frozen module tied to another tensor (like an MLM decoder tied to word embeddings)."""

    def __init__(self, embeddings: torch.nn.Embedding):
        super().__init__("tied")
        self.proj = torch.nn.Linear(3, 3)
        self.norm = torch.nn.BatchNorm1d(3)
        self.decoder = torch.nn.Linear(3, embeddings.num_embeddings, bias=False).requires_grad_(False)
        self.decoder.weight = embeddings.weight


def test_last_saves_and_restores_only_trainable_weights_and_buffers(tmp_path):
    from fastprompt.train.checkpoints import METHOD_FILE, RunDirectory

    embeddings = torch.nn.Embedding(11, 3).requires_grad_(False)
    method = Method(SimCSE(), [_WithFrozenHead(embeddings)])
    state = method.resume_state()
    assert set(state) == {"terms.0.proj.weight", "terms.0.proj.bias", "terms.0.norm.weight", "terms.0.norm.bias",
                          "terms.0.norm.running_mean", "terms.0.norm.running_var", "terms.0.norm.num_batches_tracked"}
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / METHOD_FILE))

    torch.manual_seed(1)
    other = Method(SimCSE(), [_WithFrozenHead(embeddings)])
    RunDirectory.load_method(other, tmp_path)
    for name, value in method.state_dict().items():
        assert torch.equal(other.state_dict()[name], value), name
    assert other.terms[0].decoder.weight is embeddings.weight  # the tie survives loading
