"""The package version, in a module of its own so that any layer can read it without importing the package face
(``fastprompt/__init__.py`` re-exports it)."""

__version__ = "0.1.0"
