"""PromptBERT templates: a sentence wrapped as ``This sentence : "[X]" means [MASK] .``, tokenised per tokenizer.

A template is text with exactly one ``[X]`` (where the sentence goes) and usually one ``[MASK]`` (replaced by
the tokenizer's own mask token: ``[MASK]`` for BERT, ``<mask>`` for RoBERTa). The three parts are tokenised
separately, so a sentence's tokens never depend on the template and a template is never truncated:

    [lead] + before + sentence + after + [trail]

``lead``/``trail`` are the special tokens the tokenizer puts around a single text ([CLS] ... [SEP],
<s> ... </s>). Whitespace is kept where it decides the tokens, as it does for byte-level BPE (RoBERTa): a
space before ``[X]`` makes the sentence's first word a word-initial token ("Ġdog"), a space after it makes the
first word of ``after`` one; a space before ``<mask>`` is absorbed by the mask token (``lstrip``), as when
tokenising the filled-in text. WordPiece (BERT) ignores spaces between words.

``max_length`` rule (the PromptBERT code's ``max_seq_length``): it bounds the sentence's own tokens, without
the template and the special tokens, which come on top. Independently, the whole sequence must fit the model
(``model_max``): when it would not, the sentence is cut further, never the template.

Appended EOS (``append_eos``, for decoder embedders that pool their last token): the tokenizer's EOS ends every
sequence. With a template it is one more trailing token (added only when the template does not already end with
it), so it counts like the template's tokens and is never cut; a sentence whose own tokens end with the EOS
right before it does not get a second one. Without a template :func:`end_with_eos` appends it.
"""
from __future__ import annotations

from dataclasses import dataclass

SENTENCE = "[X]"
MASK = "[MASK]"
DEFAULT_TEMPLATE = 'This sentence : "[X]" means [MASK] .'  # PromptBERT's BERT template


@dataclass(frozen=True)
class Template:
    """A template tokenised for one tokenizer (build it with :func:`parse_template`)."""

    text: str
    lead: tuple[int, ...]  # special tokens before everything ([CLS] / <s>)
    before: tuple[int, ...]  # template tokens before the sentence
    after: tuple[int, ...]  # template tokens after the sentence
    trail: tuple[int, ...]  # special tokens after everything ([SEP] / </s>)
    space_before_sentence: bool  # the sentence is tokenised as a word-initial text (" " + sentence)
    mask_token_id: int | None
    eos: int | None = None  # append_eos: the EOS every sequence ends with (the last token of ``trail``)

    @property
    def overhead(self) -> int:
        """Tokens a sequence holds besides the sentence's."""
        return len(self.lead) + len(self.before) + len(self.after) + len(self.trail)

    @property
    def sentence_start(self) -> int:
        """Index of the sentence's first token in a wrapped sequence."""
        return len(self.lead) + len(self.before)

    def wrap(self, sentence_ids: list[int]) -> list[int]:
        return [*self.lead, *self.before, *sentence_ids, *self.after, *self.trail]

    def alone(self) -> list[int]:
        """The template with an empty sentence: what template denoising feeds the model."""
        return self.wrap([])

    def mask_index(self) -> int:
        """Index of the (first) mask token in :meth:`alone`; the same offset from the start in every sequence
        when it lies before the sentence, from the end when after it."""
        ids = self.alone()
        if self.mask_token_id is None or self.mask_token_id not in ids:
            raise ValueError(f"template {self.text!r} has no [MASK]")
        return ids.index(self.mask_token_id)

    def word_slots(self) -> tuple[list[int], list[int]]:
        """Indices, within ``before`` and within ``after``, of the template's words: every template token
        but the mask token (the tokens OptiPrompt makes trainable)."""
        keep = lambda part: [i for i, t in enumerate(part) if t != self.mask_token_id]  # noqa: E731
        return keep(self.before), keep(self.after)

    def word_ids(self) -> list[int]:
        b, a = self.word_slots()
        return [self.before[i] for i in b] + [self.after[i] for i in a]


def special_tokens_around(tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The special tokens a tokenizer puts before and after a single text: those of an empty input."""
    empty = tokenizer("")["input_ids"]
    lead = 1 if len(empty) >= 2 else 0
    return tuple(empty[:lead]), tuple(empty[lead:])


def eos_token_id(tokenizer, model: str | None = None) -> int:
    """The id ``append_eos`` appends: the tokenizer's EOS token; a clear ``ValueError`` when it has none."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise ValueError(f"append_eos=True ends every sequence with the tokenizer's EOS token, but the tokenizer "
                         f"of {model or type(tokenizer).__name__!r} has no EOS token; set its eos_token, or leave "
                         "append_eos off (encoders end their sequences with their own special tokens)")
    return eos


def end_with_eos(ids: list[int], eos: int, limit: int) -> list[int]:
    """``ids`` ending with ``eos``: unchanged when they already do, else with ``eos`` appended, after cutting the
    last token when the row already holds ``limit`` tokens (so the EOS itself is never truncated away)."""
    return list(ids) if ids[-1:] == [eos] else [*ids[:limit - 1], eos]


def parse_template(tokenizer, text: str, eos: int | None = None) -> Template:
    """Tokenise a template for ``tokenizer``; a clear ``ValueError`` when it is malformed. ``eos``: an EOS id every
    sequence must end with (``append_eos``), added after the trailing special tokens unless already last."""
    if not isinstance(text, str):
        raise TypeError(f"template must be a str, got {type(text).__name__}")
    if text.count(SENTENCE) != 1:
        raise ValueError(f"template must contain the sentence placeholder {SENTENCE} exactly once: {text!r}")
    if MASK in text and tokenizer.mask_token is None:
        raise ValueError(f"template {text!r} uses {MASK} but the tokenizer has no mask token")
    before, after = text.split(SENTENCE)
    if MASK in text:
        before, after = before.replace(MASK, tokenizer.mask_token), after.replace(MASK, tokenizer.mask_token)

    def enc(part: str) -> tuple[int, ...]:
        return tuple(tokenizer(part, add_special_tokens=False)["input_ids"]) if part.strip() else ()

    lead, trail = special_tokens_around(tokenizer)
    after_ids = enc(after.rstrip())
    if eos is not None and (after_ids + trail)[-1:] != (eos,):
        trail = (*trail, eos)
    # The template's trailing space belongs to the sentence (BPE would make it a token of its own).
    space = before[-1:].isspace() if before.strip() else False
    return Template(text=text, lead=lead, before=enc(before.strip()), after=after_ids, trail=trail,
                    space_before_sentence=space, mask_token_id=tokenizer.mask_token_id, eos=eos)


def tokenize_sentences(tokenizer, template: Template, sentences: list[str]) -> list[list[int]]:
    """Each sentence's own token ids as they read inside the template (no special tokens, not truncated)."""
    texts = [(" " + s.strip()) if template.space_before_sentence else s.strip() for s in sentences]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def wrap_batch(tokenizer, template: Template, sentences: list[str], max_length: int | None,
               model_max: int) -> list[list[int]]:
    """Token ids of each sentence inside the template, truncated by the rule in the module docstring."""
    room = model_max - template.overhead
    if room < 1:
        raise ValueError(f"template {template.text!r} takes {template.overhead} tokens: no room for a sentence "
                         f"in the model's {model_max} positions")
    if max_length is not None:
        room = min(room, max_length)
    sentences_ids = tokenize_sentences(tokenizer, template, sentences)
    if template.eos is not None and (template.after + template.trail)[:1] == (template.eos,):
        # the sentence's own trailing EOS would stand right before the template's: keep one
        sentences_ids = [ids[:-1] if ids[-1:] == [template.eos] else ids for ids in sentences_ids]
    return [template.wrap(ids[:room]) for ids in sentences_ids]
