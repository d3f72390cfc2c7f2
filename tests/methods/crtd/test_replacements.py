"""The replacement file made ahead of training: the generator batched over sentences writes the same lines as one
sentence at a time, and training refuses a file made with other settings (generator, masking ratio, sampling
mode, backbone)."""
import json
import random
import shutil

import pytest
import torch
from transformers import (
    AutoTokenizer,
    BertConfig,
    BertForMaskedLM,
    DistilBertConfig,
    DistilBertForMaskedLM,
    RobertaConfig,
    RobertaForMaskedLM,
)

from fastprompt.data.replacements import (
    MaskedLMGenerator,
    RandomGenerator,
    ReplacementGenerator,
    ReplacementTable,
    replacement_settings,
    sentence_seed,
    write_replacement_file,
)
from fastprompt.methods.crtd.config import CRTDConfig
from fastprompt.methods.crtd.term import build_crtd_term
from fastprompt.model import PromptEncoder

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


WORDS = "man woman dog cat plays runs eating guitar ball park street car red blue big small two people".split()


def _sentences(tok, n=40, seed=0):
    """Token ids of n sentences of 1-8 words (so many share a length), with a few duplicates."""
    rng = random.Random(seed)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8))) for _ in range(n)]
    return [tok(t)["input_ids"] for t in texts + texts[:3]]


def _model(kind, vocab_size):
    torch.manual_seed(4)
    small = dict(vocab_size=vocab_size, max_position_embeddings=64)
    if kind == "bert":
        return BertForMaskedLM(BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                          intermediate_size=32, **small))
    if kind == "roberta":
        return RobertaForMaskedLM(RobertaConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                                intermediate_size=32, pad_token_id=1, type_vocab_size=1,
                                                **dict(small, max_position_embeddings=72)))
    return DistilBertForMaskedLM(DistilBertConfig(dim=16, n_layers=2, n_heads=2, hidden_dim=32, **small))


@pytest.fixture(params=[("bert", "sample"), ("roberta", "sample"), ("distilbert", "sample"), ("bert", "argmax")],
                ids=lambda p: "-".join(p))
def generator(request, tiny_bert_dir, tiny_roberta_dir):
    kind, sampling = request.param
    tok = AutoTokenizer.from_pretrained(tiny_roberta_dir if kind == "roberta" else tiny_bert_dir)
    return MaskedLMGenerator(_model(kind, len(tok)), tok, 0.4, sampling=sampling), tok


def _one_by_one(gen, sentences, seed):
    """The reference: :meth:`corrupt` on each sentence alone, on that sentence's seeded generator."""
    out = []
    for ids in sentences:
        x = torch.tensor([ids])
        g = torch.Generator().manual_seed(sentence_seed(seed, ids))
        out.append(gen.corrupt(x, torch.ones_like(x), g)[0][0].tolist())
    return out


def test_batched_generator_equals_one_sentence_at_a_time(generator):
    gen, tok = generator
    sentences = _sentences(tok)
    assert len({len(s) for s in sentences}) < len(sentences) / 3  # groups of several sentences per length
    ref = _one_by_one(gen, sentences, seed=3)
    gens = [torch.Generator().manual_seed(sentence_seed(3, ids)) for ids in sentences]
    got = gen.corrupt_each(sentences, gens, max_rows=4)  # several groups per length, too
    assert got == ref
    assert sum(a != b for r, s in zip(ref, sentences) for a, b in zip(r, s)) > 10  # tokens really replaced
    # the base class's loop is the same definition
    gens = [torch.Generator().manual_seed(sentence_seed(3, ids)) for ids in sentences]
    assert ReplacementGenerator.corrupt_each(gen, sentences, gens) == ref


def test_the_file_is_the_one_a_sentence_at_a_time_writer_made(generator, tmp_path):
    gen, tok = generator
    sentences = _sentences(tok)
    path = tmp_path / "rep.jsonl"
    written = write_replacement_file(path, sentences, gen, seed=9, settings={"generator": "x"}, chunk_size=16)
    distinct = list(dict.fromkeys(map(tuple, sentences)))
    assert written == len(distinct)
    expected = "".join(json.dumps({"ids": list(ids), "replaced": rep}, separators=(",", ":")) + "\n"
                       for ids, rep in zip(distinct, _one_by_one(gen, distinct, seed=9)))
    assert path.read_text(encoding="utf-8") == expected


def test_random_generator_batched_equals_one_by_one(tiny_bert_dir):
    tok = AutoTokenizer.from_pretrained(tiny_bert_dir)
    gen = RandomGenerator(tok, 0.3)
    sentences = _sentences(tok)
    gens = [torch.Generator().manual_seed(sentence_seed(1, ids)) for ids in sentences]
    assert gen.corrupt_each(sentences, gens) == _one_by_one(gen, sentences, seed=1)


def test_mismatched_generator_and_sentences_are_refused(generator):
    gen, tok = generator
    with pytest.raises(ValueError, match="2 sentences but 1 generators"):
        gen.corrupt_each(_sentences(tok)[:2], [torch.Generator()])


@pytest.fixture
def mlm_folder(tiny_bert_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_bert_dir)
    _model("bert", len(tok)).save_pretrained(tmp_path / "gen")
    tok.save_pretrained(tmp_path / "gen")
    return tmp_path / "gen"


def _file(tmp_path, rtd, enc):
    path = tmp_path / "rep.jsonl"
    gen = (RandomGenerator(enc.tokenizer, rtd.masking_ratio) if rtd.generator == "random" else
           MaskedLMGenerator.from_pretrained(rtd.generator, enc.tokenizer, rtd.masking_ratio, rtd.sampling))
    write_replacement_file(path, _sentences(enc.tokenizer, 4), gen, seed=0,
                           settings=replacement_settings(rtd, enc.base_model, 32))
    return path


def test_training_refuses_a_file_of_another_sampling_mode_or_backbone(tiny_bert_dir, mlm_folder, tmp_path):
    enc = PromptEncoder.from_pretrained(tiny_bert_dir)
    made = CRTDConfig(weight=0.005, generator=str(mlm_folder), sampling="sample")
    path = _file(tmp_path, made, enc)
    assert ReplacementTable(path).settings["model"] == enc.base_model
    same = CRTDConfig(weight=0.005, generator=str(mlm_folder), sampling="sample", replacements_file=str(path))
    assert build_crtd_term(same, enc).replacer.path == path
    argmax = CRTDConfig(weight=0.005, generator=str(mlm_folder), sampling="argmax", replacements_file=str(path))
    with pytest.raises(ValueError, match="sampling='sample'.*sampling='argmax'"):
        build_crtd_term(argmax, enc)
    other_dir = tmp_path / "other-bert"
    shutil.copytree(tiny_bert_dir, other_dir)  # the same weights and vocabulary, but another backbone
    other = PromptEncoder.from_pretrained(other_dir)
    with pytest.raises(ValueError, match="model=.*other-bert"):
        build_crtd_term(same, other)
    ratio = CRTDConfig(weight=0.005, generator=str(mlm_folder), masking_ratio=0.2, replacements_file=str(path))
    with pytest.raises(ValueError, match="masking_ratio=0.3.*masking_ratio=0.2"):
        build_crtd_term(ratio, enc)


def test_the_random_generator_has_no_sampling_mode_to_refuse(tiny_bert_dir, tmp_path):
    enc = PromptEncoder.from_pretrained(tiny_bert_dir)
    path = _file(tmp_path, CRTDConfig(weight=0.005, generator="random", sampling="argmax"), enc)
    asked = CRTDConfig(weight=0.005, generator="random", sampling="sample", replacements_file=str(path))
    assert build_crtd_term(asked, enc).replacer.path == path


def test_a_relative_model_path_of_an_older_file_still_matches(tiny_bert_dir, tmp_path, monkeypatch):
    enc = PromptEncoder.from_pretrained(tiny_bert_dir)
    rtd = CRTDConfig(weight=0.005)
    path = _file(tmp_path, rtd, enc)
    meta = json.loads((tmp_path / "rep.jsonl.meta.json").read_text())
    monkeypatch.chdir(tiny_bert_dir.parent)
    meta["model"] = tiny_bert_dir.name  # as `make-replacements` recorded str(cfg.encoder.model) before
    (tmp_path / "rep.jsonl.meta.json").write_text(json.dumps(meta))
    build_crtd_term(CRTDConfig(weight=0.005, replacements_file=str(path)), enc)



def test_the_table_is_compact_and_joins_the_same_replacements(tmp_path):
    """~220 bytes a 20-token sentence (the class docstring's measurement); tuples and lists took ~1,500."""
    import tracemalloc

    rng = random.Random(0)
    path = tmp_path / "rep.jsonl"
    rows = []
    for _ in range(2000):
        ids = [2] + [rng.randrange(300, 30000) for _ in range(18)] + [3]
        rep = [t if i in (0, 19) or rng.random() > 0.3 else rng.randrange(300, 30000) for i, t in enumerate(ids)]
        rows.append((ids, rep))
    path.write_text("".join(json.dumps({"ids": a, "replaced": b}) + "\n" for a, b in rows), encoding="utf-8")
    (tmp_path / "rep.jsonl.meta.json").write_text("{}", encoding="utf-8")
    tracemalloc.start()
    table = ReplacementTable(path)
    size = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert len(table) == 2000 and size / 2000 < 400, size / 2000
    ids = torch.tensor([a for a, _ in rows[:5]])
    corrupted, labels = table.corrupt(ids, torch.ones_like(ids))
    assert corrupted.tolist() == [b for _, b in rows[:5]]
    assert torch.equal(labels[:, 1:], (corrupted != ids).long()[:, 1:])
