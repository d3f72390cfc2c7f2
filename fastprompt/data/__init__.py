"""Corpus readers, tokenisation / collation and batch samplers (text -> token ids)."""
