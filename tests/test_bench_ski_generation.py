"""Smoke test of bench/bench_ski_generation.py on a tiny random Llama: every batch size answers every sentence,
does the same work (greedy decoding: the same tokens at every batch size) and the CSV says so in the harness's
schema."""
import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_ski_generation.py"
WORDS = "the a cat dog sat ran on in mat park sentence answer what you know about is was it and of".split()


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A random 2-layer Llama with a word-level tokenizer and a chat template, saved offline."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-llama")
    vocab = {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "<unk>", "<user>", "<assistant>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                        pad_token="<pad>", additional_special_tokens=["<user>", "<assistant>"])
    tokenizer.chat_template = ("{% for m in messages %}<user> {{ m['content'] }} </s> {% endfor %}"
                               "{% if add_generation_prompt %}<assistant>{% endif %}")
    tokenizer.save_pretrained(path)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_ski_generation_bench_measures_every_batch_size(tiny_llama, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat\na dog ran in the park\nwhat is it\nthe sentence\nyou know\n",
                      encoding="utf-8")
    out = tmp_path / "ski.csv"
    proc = subprocess.run([sys.executable, str(BENCH), "--model", str(tiny_llama), "--input", str(corpus),
                           "--sentences", "5", "--batch-sizes", "1,4", "--max-new-tokens", "4", "--repeats", "2",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(out.open()))
    assert [(r["provider"], r["batch_size"]) for r in rows] == [("batch_1", "1"), ("batch_4", "4")]
    for r in rows:
        assert r["bench"] == "ski_generation" and r["device"] == "cpu" and r["sentences"] == "5"
        assert float(r["median_ms"]) > 0 and int(r["repeats"]) == 2 and float(r["peak_mb"]) >= 0
        assert 0 < int(r["tokens"]) <= 5 * 4 and float(r["tokens_per_s"]) > 0
    assert rows[0]["tokens"] == rows[1]["tokens"]  # greedy: the same answers at every batch size
    assert rows[0]["time_vs_baseline"] == "1.0" and rows[1]["baseline"] == "batch_1"
    sidecar = json.loads(out.with_suffix(".json").read_text())
    assert sidecar["command"].startswith("python bench/bench_ski_generation.py ")
    assert len(sidecar["rows"]) == 2 and sidecar["machine"]["versions"]["torch"]
