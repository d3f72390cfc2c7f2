"""The trainer tests' fixtures (a tiny corpus, triplets, an STS folder, base_config, ...) are tests/conftest.py's,
shared with the methods' tests (tests/methods/<name>/)."""
