"""A toy architecture: ``model.py`` stands in for a model family transformers ships (registered with ``AutoConfig``
and ``AutoModel``), ``family.py`` is what docs/architectures.md's "Adding an architecture" asks for."""
