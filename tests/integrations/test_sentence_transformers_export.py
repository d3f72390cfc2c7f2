"""sentence-transformers export: SentenceTransformer(folder).encode equals PromptEncoder.encode.

Tolerance: both sides run the very same PromptEncoder forward in fp32; they differ only in how sentences are
batched (sentence-transformers: 32 per batch, sorted by its own length key; fastprompt: 64, sorted by characters),
so a sentence may be padded to another length. Padding is masked exactly, but a different padded length changes the
shapes of the matmuls and with them the fp32 summation order: ~1e-7 relative per op, a few 1e-7 on the unit-length
output vectors after the model's layers. 1e-5 leaves ample headroom and still catches any real mismatch (a wrong
pooler, a missing prefix or normalisation moves components by 1e-2 or more).
"""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

st = pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed")

from fastprompt import cli  # noqa: E402
from fastprompt.model import PromptConfig, PromptEncoder  # noqa: E402

ATOL = 1e-5
SENTENCES = ["a man plays guitar on the street", "the dog", "two people sitting at a table with water .",
             "a woman is eating food in the park", "red car", "one cat runs with a big blue ball"]


def _load(folder, **kwargs):
    return st.SentenceTransformer(str(folder), trust_remote_code=True, device="cpu", **kwargs)


@pytest.fixture(scope="module")
def trained_run(tiny_bert_dir, tmp_path_factory):
    """A real (short) training run of the tiny BERT: best/ holds train_info.json, the run folder summary.json."""
    from fastprompt.train import TrainConfig, Trainer

    out = tmp_path_factory.mktemp("run")
    corpus = out / "corpus.txt"
    corpus.write_text("\n".join(f"{a} {b} plays with the {c}" for a in ("man", "woman", "dog", "cat")
                                for b in ("big", "small", "red", "blue") for c in ("ball", "car", "guitar")) + "\n",
                      encoding="utf-8")
    config = TrainConfig(model=str(tiny_bert_dir), train_file=str(corpus), output_dir=str(out / "run"), batch_size=8,
                         max_length=16, prompt_length=4, learning_rate=1e-2, max_steps=4, eval_steps=4, log_every=2,
                         num_threads=1, progress_bar=False, seed=3, pooler="mean")
    Trainer(config).train()
    return out / "run"


def test_trained_prompt_round_trips_through_the_cli(trained_run, tmp_path, capsys):
    """The must-show: `fastprompt export` of a trained checkpoint, loaded by SentenceTransformer, encodes the same."""
    out = tmp_path / "st"
    assert cli.main(["export", "--prompt", str(trained_run / "best"), "--to", "sentence-transformers",
                     "--output", str(out)]) == 0
    assert "wrote sentence-transformers model" in capsys.readouterr().out
    ours = PromptEncoder.load(trained_run / "best").encode(SENTENCES)
    theirs = _load(out).encode(SENTENCES)
    assert theirs.shape == ours.shape
    np.testing.assert_allclose(theirs, ours, atol=ATOL, rtol=0)
    card = (out / "README.md").read_text(encoding="utf-8")
    assert "library_name: sentence-transformers" in card
    assert "| pooler | `mean` |" in card
    assert "objective: simcse" in card and "InfoNCE" in card  # training config + method from train_info.json
    assert "trust_remote_code=True" in card


def test_real_minilm_with_a_random_prompt(minilm_dir, tmp_path):
    """all-MiniLM-L6-v2 (6 layers, 384 wide, real weights) with a random prompt and sentence-transformers' own
    settings for it (mean pooling, 256 tokens)."""
    from fastprompt.integrations.sentence_transformers import export_sentence_transformers

    torch.manual_seed(0)
    encoder = PromptEncoder.from_pretrained(minilm_dir, prompt_config=PromptConfig(prompt_length=8, init_std=0.5),
                                            pooler="mean", max_length=256).eval()
    model = _load(export_sentence_transformers(encoder, tmp_path / "st"))
    assert model.max_seq_length == 256 and model.get_embedding_dimension() == 384
    np.testing.assert_allclose(model.encode(SENTENCES), encoder.encode(SENTENCES), atol=ATOL, rtol=0)
    # the prompt matters: the frozen model alone gives other vectors
    plain = PromptEncoder.from_pretrained(minilm_dir, pooler="mean", max_length=256).encode(SENTENCES)
    assert np.abs(plain - encoder.encode(SENTENCES)).max() > 1e-2


@pytest.mark.parametrize("case", ["template_cls_prompt_shifted", "head_projection_roberta", "unnormalised"])
def test_pooler_template_and_normalisation_are_preserved(case, tiny_bert_dir, tiny_roberta_dir, tmp_path):
    from fastprompt.integrations.sentence_transformers import export_sentence_transformers

    torch.manual_seed(1)
    normalize = case != "unnormalised"
    if case == "template_cls_prompt_shifted":
        encoder = PromptEncoder.from_pretrained(
            tiny_bert_dir, pooler="mask", template='the sentence "[X]" means [MASK] .',
            prompt_config=PromptConfig(prompt_length=3, cls_prompt=True, position_mode="shifted", init_std=0.5))
    elif case == "head_projection_roberta":
        encoder = PromptEncoder.from_pretrained(
            tiny_roberta_dir, pooler="cls", mlp="always",
            prompt_config=PromptConfig(prompt_length=2, prefix_projection=True, projection_hidden_size=8))
    else:
        encoder = PromptEncoder.from_pretrained(tiny_bert_dir, pooler="cls_before_pooler", max_length=8,
                                                prompt_config=PromptConfig(prompt_length=5, init_std=0.5))
    encoder.eval()
    out = export_sentence_transformers(encoder, tmp_path / "st", normalize=normalize)
    theirs = _load(out).encode(SENTENCES)
    ours = encoder.encode(SENTENCES, normalize=normalize)
    np.testing.assert_allclose(theirs, ours, atol=ATOL, rtol=0)
    if not normalize:
        assert not np.allclose(np.linalg.norm(theirs, axis=1), 1.0)
    modules = json.loads((out / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[-1] for m in modules] == (["PromptEncoderModule", "Normalize"] if normalize
                                                              else ["PromptEncoderModule"])


def test_without_backbone_the_module_names_the_base_model(tiny_bert_dir, tmp_path):
    from fastprompt.integrations.sentence_transformers import export_sentence_transformers

    encoder = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(prompt_length=2)).eval()
    out = export_sentence_transformers(encoder, tmp_path / "st", include_backbone=False)
    assert not (out / "model.safetensors").exists()
    assert json.loads((out / "fastprompt_module.json").read_text())["base_model"] == str(tiny_bert_dir)
    np.testing.assert_allclose(_load(out).encode(SENTENCES), encoder.encode(SENTENCES), atol=ATOL, rtol=0)


def test_resaving_through_sentence_transformers_keeps_the_model(tiny_bert_dir, tmp_path):
    """SentenceTransformer.save of a loaded export writes a folder that loads to the same model."""
    from fastprompt.integrations.sentence_transformers import export_sentence_transformers

    torch.manual_seed(2)
    encoder = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(prompt_length=2, init_std=0.5))
    model = _load(export_sentence_transformers(encoder, tmp_path / "a"))
    model.save(str(tmp_path / "b"))
    np.testing.assert_allclose(_load(tmp_path / "b").encode(SENTENCES), model.encode(SENTENCES), atol=ATOL, rtol=0)


def test_loading_needs_trust_remote_code(tiny_bert_dir, tmp_path):
    """sentence-transformers >= 6 imports a module class from outside its package only when trusted."""
    from fastprompt.integrations.sentence_transformers import export_sentence_transformers

    encoder = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(prompt_length=2))
    out = export_sentence_transformers(encoder, tmp_path / "st")
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        st.SentenceTransformer(str(out), device="cpu")


def test_model_card_has_the_runs_sts_table(tiny_bert_dir, tmp_path):
    """A checkpoint that is its run's best/ gets the run's test table; another checkpoint of the run does not."""
    from fastprompt.integrations.sentence_transformers import export_sentence_transformers

    run = tmp_path / "run"
    encoder = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(prompt_length=2))
    for name in ("best", "last"):
        encoder.save(run / name)
    config = {"objective": "promcse_eh", "learning_rate": 0.01, "batch_size": 64}
    (run / "best" / "train_info.json").write_text(json.dumps({"step": 250, "stsb_dev": 81.234, "config": config}))
    test = {"sts12": 70.1, "sts13": 80.2, "sts14": 75.3, "sts15": 82.4, "sts16": 78.5, "stsb": 79.6, "sickr": 71.7,
            "avg": 76.83}
    (run / "summary.json").write_text(json.dumps({"best_checkpoint": str(run / "best"), "test": test,
                                                  "best_stsb_dev": 81.234, "best_step": 250, "config": config}))
    card = (export_sentence_transformers(run / "best", tmp_path / "st") / "README.md").read_text(encoding="utf-8")
    assert "| STS12 | STS13 | STS14 | STS15 | STS16 | STS-B | SICK-R | Avg. |" in card
    assert "| 70.10 | 80.20 | 75.30 | 82.40 | 78.50 | 79.60 | 71.70 | 76.83 |" in card
    assert "Selected at step 250 by STS-B dev Spearman 81.23." in card
    assert "energy-based hinge" in card and "learning_rate: 0.01" in card
    assert "## Citation" in card and "Improved Universal Sentence Embeddings with Prompt-based" in card
    card = (export_sentence_transformers(run / "last", tmp_path / "st2") / "README.md").read_text(encoding="utf-8")
    assert "STS12" not in card and "## Training" not in card


def test_export_cli_errors_are_clear(tiny_bert_dir, tmp_path, capsys):
    encoder = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(prompt_length=2))
    ckpt = encoder.save(tmp_path / "ckpt")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("user data")
    capsys.readouterr()
    cases = [
        (["--prompt", str(tmp_path / "missing"), "--output", str(tmp_path / "o1")], "not found"),
        (["--prompt", str(ckpt), "--output", str(tmp_path / "taken")],
         "is not empty and is not an earlier sentence-transformers export"),
        (["--prompt", str(ckpt), "--output", str(ckpt)], "is the input folder"),
    ]
    for args, message in cases:
        assert cli.main(["export", "--to", "sentence-transformers", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("fastprompt export: error:") and message in err, err
    assert (tmp_path / "taken" / "keep.txt").read_text() == "user data"
    out = ["export", "--to", "sentence-transformers", "--prompt", str(ckpt), "--output"]
    assert cli.main([*out, str(tmp_path / "st")]) == 0
    assert cli.main([*out, str(tmp_path / "st")]) == 0  # an earlier export is replaced without --overwrite
    assert cli.main([*out, str(tmp_path / "taken"), "--overwrite"]) == 0
    assert (tmp_path / "taken" / "modules.json").is_file() and not (tmp_path / "taken" / "keep.txt").exists()


def test_the_exported_prompt_trains_with_a_sentence_transformers_loss(tiny_bert_dir, tmp_path):
    """Only the prompt (and head) take gradients from a sentence-transformers loss; the backbone stays frozen."""
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss

    from fastprompt.integrations.sentence_transformers import export_sentence_transformers

    encoder = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(prompt_length=2))
    model = _load(export_sentence_transformers(encoder, tmp_path / "st"))
    model.train()
    loss_fn = MultipleNegativesRankingLoss(model)
    features = [model.preprocess(SENTENCES[:3]), model.preprocess(SENTENCES[3:])]
    loss_fn(features, labels=None).backward()
    module = model[0].encoder
    assert module.prompt.prefix.grad is not None and module.prompt.prefix.grad.abs().sum() > 0
    assert all(p.grad is None for p in module.backbone.parameters())


def _fake_run(run, encoder, best_checkpoint):
    """A run folder as the trainer writes it: best/ and last/, summary.json naming best/ by ``best_checkpoint``."""
    for name in ("best", "last"):
        encoder.save(run / name)
    test = {"sts12": 70.1, "stsb": 79.6, "avg": 74.85}
    (run / "summary.json").write_text(json.dumps({"best_checkpoint": best_checkpoint, "test": test}))


def test_model_card_table_from_another_directory_and_after_moving_the_run(tiny_bert_dir, tmp_path, monkeypatch):
    """summary.json names best/ by the path the run was given (relative for every shipped recipe): the table is
    found from any working directory and after the run folder moved, and still not for last/."""
    from fastprompt.integrations.sentence_transformers import export_sentence_transformers

    encoder = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(prompt_length=2))
    _fake_run(tmp_path / "runs" / "quick", encoder, "runs/quick/best")  # as trained from tmp_path
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    row = "| 70.10 | 79.60 | 74.85 |"

    def card(checkpoint, name):
        return (export_sentence_transformers(checkpoint, tmp_path / name) / "README.md").read_text(encoding="utf-8")

    assert row in card(tmp_path / "runs" / "quick" / "best", "st1")
    assert row in card(Path("..") / "runs" / "quick" / "best", "st2")  # a relative argument, another cwd
    (tmp_path / "runs" / "quick").rename(tmp_path / "moved")
    assert row in card(tmp_path / "moved" / "best", "st3")
    assert row not in card(tmp_path / "moved" / "last", "st4")


def test_export_replaces_only_an_earlier_export(tiny_bert_dir, tmp_path):
    from fastprompt.integrations.sentence_transformers import export_sentence_transformers

    encoder = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(prompt_length=2))
    ckpt = encoder.save(tmp_path / "ckpt")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("user data")
    with pytest.raises(FileExistsError, match="is not empty and is not an earlier sentence-transformers export"):
        export_sentence_transformers(encoder, taken)
    assert (taken / "notes.txt").read_text() == "user data"
    with pytest.raises(ValueError, match="is the input folder"):
        export_sentence_transformers(ckpt, ckpt, overwrite=True)
    out = export_sentence_transformers(encoder, tmp_path / "st")
    export_sentence_transformers(ckpt, out)  # an earlier export is replaced
    export_sentence_transformers(encoder, taken, overwrite=True)
    assert not (taken / "notes.txt").exists() and (taken / "modules.json").is_file()


def test_fine_tuned_backbone_is_stored_once(tiny_bert_dir, tmp_path):
    """train_backbone: the backbone lives in prompt/ (a complete checkpoint) and not again at the root; the folder
    encodes as fastprompt does, re-saving keeps one copy, and leaving the backbone out is refused."""
    from fastprompt.integrations.sentence_transformers import export_sentence_transformers

    torch.manual_seed(4)
    encoder = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(prompt_length=2, init_std=0.5))
    encoder.train_backbone()
    with torch.no_grad():
        for p in encoder.backbone.parameters():
            p.add_(0.05 * torch.randn_like(p))
    encoder.eval()
    ckpt = encoder.save(tmp_path / "ckpt")
    out = export_sentence_transformers(ckpt, tmp_path / "st")
    assert [p.relative_to(out).as_posix() for p in out.rglob("model.safetensors")] == ["prompt/model.safetensors"]
    model = _load(out)
    np.testing.assert_allclose(model.encode(SENTENCES), encoder.encode(SENTENCES), atol=ATOL, rtol=0)
    assert "(fine-tuned with the prompt)" in (out / "README.md").read_text(encoding="utf-8")
    model.save(str(tmp_path / "again"))
    assert len(list((tmp_path / "again").rglob("model.safetensors"))) == 1
    np.testing.assert_allclose(_load(tmp_path / "again").encode(SENTENCES), encoder.encode(SENTENCES), atol=ATOL,
                               rtol=0)
    with pytest.raises(ValueError, match="backbone is fine-tuned"):
        export_sentence_transformers(ckpt, tmp_path / "nb", include_backbone=False)
    assert not (tmp_path / "nb").exists()


@pytest.mark.parametrize("prompt_path", ["../victim", "/abs/victim", "prompt/../../victim", "link"])
def test_a_prompt_path_outside_the_folder_is_refused_on_load_and_on_save(tiny_bert_dir, tmp_path, prompt_path):
    """A module config whose prompt_path leaves the folder made loading read, and SentenceTransformer.save(out)
    rewrite, a checkpoint outside ``out``: refused, and the checkpoint outside is byte-identical afterwards."""
    from fastprompt.integrations.sentence_transformers import PromptEncoderModule, export_sentence_transformers

    encoder = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(prompt_length=2))
    victim = encoder.save(tmp_path / "victim")
    before = {p.name: p.read_bytes() for p in victim.iterdir()}
    folder = export_sentence_transformers(encoder, tmp_path / "st")
    (folder / "link").symlink_to(victim)  # a relative name that resolves outside the folder
    prompt_path = prompt_path.replace("/abs/victim", str(victim))
    config = json.loads((folder / "fastprompt_module.json").read_text())
    (folder / "fastprompt_module.json").write_text(json.dumps(dict(config, prompt_path=prompt_path)))
    with pytest.raises(ValueError, match="prompt_path must be a folder inside the model folder"):
        _load(folder)
    if prompt_path != "link":  # a symlink only leads out of a folder that holds it: the loaded one
        with pytest.raises(ValueError, match="prompt_path must be a folder inside the model folder"):
            PromptEncoderModule(encoder, prompt_path=prompt_path)
        module = PromptEncoderModule(encoder)
        module.prompt_path = prompt_path  # set after construction: save checks again
        with pytest.raises(ValueError, match="prompt_path must be a folder inside the model folder"):
            module.save(str(tmp_path / "out"))
    assert {p.name: p.read_bytes() for p in victim.iterdir()} == before


def test_every_registered_objective_carries_its_model_card_text():
    """The model card's "method" row and citation come from the objective's class (sentence-transformers' pattern),
    not from a list kept by hand beside it: every built-in objective says what it is and which paper it is from."""
    from fastprompt.integrations.sentence_transformers import _objective_card
    from fastprompt.objectives.config import OBJECTIVE_REGISTRY
    from fastprompt.objectives.registry import objective_class

    for name in OBJECTIVE_REGISTRY:
        cls = objective_class(name)
        assert vars(cls).get("description"), f"{cls.__name__} has no description of its own"
        assert vars(cls).get("citation", "").startswith("@"), f"{cls.__name__} has no BibTeX citation"
        assert _objective_card(name) == (cls.description, cls.citation)
    assert _objective_card("not_registered") == ("`not_registered`", "")
