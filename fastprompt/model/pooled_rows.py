"""The last layer for the rows the pooler reads only (a packed batch with ``cls``, ``mask`` or ``last`` pooling).

Only one token per sequence leaves the backbone into a sentence vector, so the last layer's queries, attention
output, output projection and feed-forward run for those rows only; its keys and values still come from every
token (the pooled row attends to its whole sequence and the prefix). For a 6-layer MiniLM that is about a sixth of
the step's matrix work.

A family's spec names the last-layer class and the function that computes its pooled rows
(:attr:`fastprompt.model.arch.Family.pooled_rows`; BERT-like encoders: :func:`fastprompt.model.arch.bert.layer_rows`).
:func:`install` replaces that one module instance's ``forward`` with :func:`_rows_forward`, which runs the original
forward unless the :class:`~fastprompt.model.attention.PrefixState` of the call names pooled rows.
"""
from __future__ import annotations

import functools


def install(layers, cls: type, rows) -> bool:
    """Let the last of ``layers`` (the backbone's layer list) compute pooled rows only with ``rows(layer, hidden,
    state)`` when it is a ``cls`` (exactly) in the plain encoder layout; False otherwise (it then always runs
    whole)."""
    if not layers:
        return False
    last = layers[-1]
    if type(last) is not cls or getattr(last, "is_decoder", False) or \
            hasattr(last, "crossattention") or getattr(last, "chunk_size_feed_forward", 0):
        return False
    last.forward = functools.partial(_rows_forward, last, last.forward, rows)
    return True


def _rows_forward(layer, whole, rows, hidden_states, *args, fastprompt_state=None, **kwargs):
    state = fastprompt_state
    if state is None or state.pooled_rows is None:
        return whole(hidden_states, *args, fastprompt_state=state, **kwargs)
    return rows(layer, hidden_states, state)
