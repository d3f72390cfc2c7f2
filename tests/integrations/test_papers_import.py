"""PromCSE/DCPCSE checkpoints -> fastprompt prompts, checked against the papers' own forward math.

The fixture is a checkpoint folder in their layout, written here from a tiny BERT/RoBERTa with the key names of their
``promcse/models.py`` (``bert.*``/``roberta.*``, ``prefix_encoder.embedding.weight``, ``prefix_encoder.trans.*``,
``mlp.dense.*``, ``lm_head.*``) as their pinned transformers 4.2.1 saves them: the embeddings' ``position_ids`` buffer
was persistent then, so ``bert.embeddings.position_ids`` / ``roberta.embeddings.position_ids`` (int64, (1, max
positions)) is in the state dict, and ``cl_init`` creates the ``mlp`` head only for ``pooler_type cls``, so a
``cls_before_pooler`` checkpoint has no ``mlp.dense.*``.

The reference reimplements their ``get_prompt`` (view (B, P, 2L, H, D), permute [2, 0, 3, 1, 4], split in pairs)
and ``sentemb_forward`` (P ones before the mask, the prefix as past key/values, positions left to the model) with a
transformers ``DynamicCache``, which is what their tuple past_key_values became (passed as ``cache`` where the
installed transformers has renamed the argument).

Tolerance: the reference and fastprompt's attention path compute the same fp32 attention over [prefix; tokens]
(fastprompt's fused op may reduce in another order: ~1e-7 relative per layer); pooled outputs are O(1), and the tanh
head only contracts differences, so 1e-5 absolute is a safe bound that any layout error (a transposed prefix, a
swapped key/value, unshifted positions) exceeds by orders of magnitude.
"""
import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModel, AutoTokenizer, DynamicCache

from fastprompt import cli
from fastprompt.integrations import papers
from fastprompt.integrations._common import prefix_from_rows
from fastprompt.model import PromptEncoder
from fastprompt.model.attention import cache_keyword

ATOL = 1e-5
SENTENCES = ["a man plays guitar on the street", "the dog", "two people sitting at a table with water ."]


class TheirModel:
    """The papers' BertForCL/RobertaForCL at inference (sent_emb=True), from their state dict."""

    def __init__(self, base_dir, P, projection, prefix_hidden_size=16, seed=0, pooler_type="cls"):
        torch.manual_seed(seed)
        self.backbone = AutoModel.from_pretrained(base_dir, add_pooling_layer=False).eval()
        cfg = self.backbone.config
        self.arch = cfg.model_type
        self.P, self.L, self.H = P, cfg.num_hidden_layers, cfg.num_attention_heads
        hidden = cfg.hidden_size
        self.projection = projection
        if projection:
            self.embedding = torch.nn.Embedding(P, hidden)
            self.trans = torch.nn.Sequential(torch.nn.Linear(hidden, prefix_hidden_size), torch.nn.Tanh(),
                                             torch.nn.Linear(prefix_hidden_size, self.L * 2 * hidden))
        else:
            self.embedding = torch.nn.Embedding(P, self.L * 2 * hidden)
        self.max_positions = cfg.max_position_embeddings
        self.mlp = torch.nn.Linear(hidden, hidden) if pooler_type == "cls" else None  # their cl_init

    def state_dict(self) -> dict[str, torch.Tensor]:
        state = {f"{self.arch}.{k}": v for k, v in self.backbone.state_dict().items()}
        # transformers 4.2.1's persistent position-ids buffer
        state[f"{self.arch}.embeddings.position_ids"] = torch.arange(self.max_positions).expand((1, -1))
        state["prefix_encoder.embedding.weight"] = self.embedding.weight.data
        if self.projection:
            state.update({f"prefix_encoder.trans.{k}": v for k, v in self.trans.state_dict().items()})
        if self.mlp is not None:
            state["mlp.dense.weight"], state["mlp.dense.bias"] = self.mlp.weight.data, self.mlp.bias.data
        state["lm_head.bias"] = torch.zeros(7)  # do_mlm's head: not part of the embedding
        return state

    @torch.no_grad()
    def get_prompt(self, batch_size):
        tokens = torch.arange(self.P).unsqueeze(0).expand(batch_size, -1)
        rows = self.trans(self.embedding(tokens)) if self.projection else self.embedding(tokens)
        head_dim = rows.shape[-1] // (self.L * 2 * self.H)
        return rows.view(batch_size, self.P, self.L * 2, self.H, head_dim).permute([2, 0, 3, 1, 4]).split(2)

    @torch.no_grad()
    def sentence_embedding(self, batch, pooler_type, mlp_only_train):
        B = batch["input_ids"].shape[0]
        cache = DynamicCache()
        for layer, kv in enumerate(self.get_prompt(B)):
            cache.update(kv[0], kv[1], layer)
        mask = torch.cat([torch.ones(B, self.P, dtype=batch["attention_mask"].dtype), batch["attention_mask"]], 1)
        out = self.backbone(batch["input_ids"], attention_mask=mask, token_type_ids=batch.get("token_type_ids"),
                            use_cache=True, **{cache_keyword(self.backbone): cache})
        pooled = out.last_hidden_state[:, 0]
        if pooler_type == "cls" and not mlp_only_train:
            pooled = torch.tanh(self.mlp(pooled))
        return pooled

    def save(self, folder, base_dir, fmt):
        folder.mkdir(parents=True)
        state = {k: v.contiguous() for k, v in self.state_dict().items()}
        if fmt == "safetensors":
            save_file(state, str(folder / "model.safetensors"))
        else:
            torch.save(state, folder / "pytorch_model.bin")
        config = json.loads((base_dir / "config.json").read_text())
        config["architectures"] = ["BertForCL" if self.arch == "bert" else "RobertaForCL"]
        (folder / "config.json").write_text(json.dumps(config))
        AutoTokenizer.from_pretrained(base_dir).save_pretrained(folder)
        return folder


CASES = [  # (architecture, projection, pooler_type, mlp_only_train, weights format)
    ("bert", False, "cls_before_pooler", False, "bin"),
    ("bert", True, "cls", False, "safetensors"),
    ("bert", False, "cls", True, "safetensors"),
    ("roberta", True, "cls_before_pooler", False, "bin"),
    ("roberta", False, "cls", False, "bin"),
]


@pytest.mark.parametrize("arch, projection, pooler_type, mlp_only_train, fmt", CASES)
def test_imported_prompt_matches_their_forward(tiny_bert_dir, tiny_roberta_dir, tmp_path, arch, projection,
                                               pooler_type, mlp_only_train, fmt):
    base = tiny_bert_dir if arch == "bert" else tiny_roberta_dir
    theirs = TheirModel(base, P=4, projection=projection, pooler_type=pooler_type)
    state = theirs.state_dict()
    assert f"{arch}.embeddings.position_ids" in state and ("mlp.dense.weight" in state) == (pooler_type == "cls")
    ckpt = theirs.save(tmp_path / "their-checkpoint", base, fmt)
    # a backbone held only as a pickle is never loaded as a model: such a folder needs the base model named
    base_model = base if fmt == "bin" else None
    out = papers.import_promcse(ckpt, tmp_path / "prompt", pooler_type=pooler_type, mlp_only_train=mlp_only_train,
                                base_model=base_model)
    saved = json.loads((out / "fastprompt_config.json").read_text())
    assert saved["prompt_config"]["position_mode"] == "shifted"
    assert saved["prompt_config"]["prefix_projection"] is projection
    assert saved["prompt_config"]["prompt_dropout"] == 0.1  # their get_prompt's dropout (hidden_dropout_prob)
    # the frozen backbone inside their folder, unless it is a pickle
    assert saved["base_model"] == str(base if base_model else ckpt.resolve())
    batch = dict(AutoTokenizer.from_pretrained(base)(SENTENCES, padding=True, return_tensors="pt"))
    expected = theirs.sentence_embedding(batch, pooler_type, mlp_only_train)
    for mode in ("attention", "cache"):  # the fused path and fastprompt's own DynamicCache reference path
        encoder = PromptEncoder.load(out, prefix_mode=mode).eval()
        with torch.no_grad():
            ours = encoder(batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids"))
        torch.testing.assert_close(ours, expected, atol=ATOL, rtol=0)
    # the head of a cls + mlp_only_train checkpoint is kept for training, and applies there only
    assert encoder.pooler.mlp == {"cls": "train" if mlp_only_train else "always"}.get(pooler_type, "none")


def test_cli_import_with_their_arguments_file_and_a_base_model(tiny_bert_dir, tmp_path, capsys, caplog):
    theirs = TheirModel(tiny_bert_dir, P=3, projection=True, prefix_hidden_size=12)
    ckpt = theirs.save(tmp_path / "ckpt", tiny_bert_dir, "bin")
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"pooler_type": "cls", "mlp_only_train": True, "pre_seq_len": 3,
                                "prefix_projection": True, "prefix_hidden_size": 12, "learning_rate": 0.005}))
    assert cli.main(["import", "--from", "dcpcse", "--checkpoint", str(ckpt), "--args", str(args),
                     "--model", str(tiny_bert_dir), "--output", str(tmp_path / "out")]) == 0
    assert "wrote prompt checkpoint" in capsys.readouterr().out
    assert "is not the backbone" not in caplog.text  # the same frozen backbone
    encoder = PromptEncoder.load(tmp_path / "out").eval()
    assert encoder.base_model == str(tiny_bert_dir) and encoder.pooler.mlp == "train"
    batch = dict(encoder.tokenize(SENTENCES))
    with torch.no_grad():
        ours = encoder(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    torch.testing.assert_close(ours, theirs.sentence_embedding(batch, "cls", True), atol=ATOL, rtol=0)


def test_a_pickled_backbone_needs_the_base_model_named(tiny_bert_dir, tmp_path, capsys):
    """Their pytorch_model.bin gives the prompt (restricted unpickler), but is never loaded as the backbone model:
    without --model the import says so, in one line."""
    theirs = TheirModel(tiny_bert_dir, P=2, projection=False, pooler_type="cls_before_pooler")
    ckpt = theirs.save(tmp_path / "ckpt", tiny_bert_dir, "bin")
    assert cli.main(["import", "--from", "promcse", "--checkpoint", str(ckpt), "--pooler-type", "cls_before_pooler",
                     "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "holds its backbone only as a PyTorch pickle (pytorch_model.bin), and fastprompt loads models from " \
           "safetensors only; pass the base model" in err, err
    assert not (tmp_path / "out").exists()


def test_safetensors_is_preferred_over_the_pickle(tiny_bert_dir, tmp_path, caplog):
    """With both files, the prompt comes from model.safetensors and pytorch_model.bin is never unpickled."""
    theirs = TheirModel(tiny_bert_dir, P=2, projection=False, pooler_type="cls_before_pooler")
    ckpt = theirs.save(tmp_path / "ckpt", tiny_bert_dir, "safetensors")
    other = {k: v.clone() for k, v in theirs.state_dict().items()}
    other["prefix_encoder.embedding.weight"] += 1.0  # a stale pickle beside it, with another prompt
    torch.save(other, ckpt / "pytorch_model.bin")
    with caplog.at_level("INFO", logger="fastprompt.integrations"):
        out = papers.import_promcse(ckpt, tmp_path / "out", pooler_type="cls_before_pooler")
    assert "torch.load" not in caplog.text
    prefix = PromptEncoder.load(out).prompt.prefix.data
    assert torch.equal(prefix, prefix_from_rows(theirs.embedding.weight.data, theirs.L, theirs.H))


def test_a_different_base_model_is_flagged(tiny_bert_dir, tmp_path, caplog):
    theirs = TheirModel(tiny_bert_dir, P=2, projection=False, pooler_type="cls_before_pooler")
    with torch.no_grad():
        theirs.backbone.embeddings.word_embeddings.weight.add_(1.0)  # as if trained on another backbone
    ckpt = theirs.save(tmp_path / "ckpt", tiny_bert_dir, "safetensors")
    papers.import_promcse(ckpt, tmp_path / "out", pooler_type="cls_before_pooler", base_model=tiny_bert_dir)
    assert "is not the backbone stored in the checkpoint" in caplog.text


def test_import_errors_are_clear(tiny_bert_dir, tmp_path, capsys):
    theirs = TheirModel(tiny_bert_dir, P=2, projection=True, prefix_hidden_size=12)
    ckpt = theirs.save(tmp_path / "ckpt", tiny_bert_dir, "safetensors")
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"pre_seq_len": 16}))
    plain = tmp_path / "plain"
    plain.mkdir()
    save_file({"bert.embeddings.word_embeddings.weight": torch.zeros(3, 4)}, str(plain / "model.safetensors"))
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (["--checkpoint", str(ckpt)], "give the checkpoint's pooler type"),
        (["--checkpoint", str(ckpt), "--pooler-type", "cls", "--args", str(args)], "pre_seq_len=16"),
        (["--checkpoint", str(plain), "--pooler-type", "cls"], "not a PromCSE/DCPCSE checkpoint"),
        (["--checkpoint", str(empty), "--pooler-type", "cls"], "neither model.safetensors nor pytorch_model.bin"),
        (["--checkpoint", str(ckpt), "--pooler", "mean"], "--pooler applies to --from peft"),
    ]
    for extra, message in cases:
        assert cli.main(["import", "--from", "promcse", "--output", str(tmp_path / "out"), *extra]) == 2
        err = capsys.readouterr().err
        assert "fastprompt import: error:" in err and message in err, err
    assert not (tmp_path / "out").exists()


def test_output_holding_other_files_needs_overwrite(tiny_bert_dir, tmp_path, capsys):
    theirs = TheirModel(tiny_bert_dir, P=2, projection=False, pooler_type="cls_before_pooler")
    ckpt = theirs.save(tmp_path / "ckpt", tiny_bert_dir, "safetensors")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("user data")
    argv = ["import", "--from", "promcse", "--checkpoint", str(ckpt), "--pooler-type", "cls_before_pooler",
            "--output", str(taken)]
    assert cli.main(argv) == 2
    assert "holds other files (notes.txt)" in capsys.readouterr().err and (taken / "notes.txt").is_file()
    assert cli.main([*argv, "--overwrite"]) == 0
    assert not (taken / "notes.txt").exists() and PromptEncoder.load(taken).prompt_length == 2
    assert cli.main(argv) == 0  # an earlier prompt checkpoint is replaced without --overwrite
    assert cli.main([*argv[:-1], str(ckpt)]) == 2
    assert "is the input folder" in capsys.readouterr().err
