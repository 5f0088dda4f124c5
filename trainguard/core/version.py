"""The package version (here so that every layer can name it without importing the top)."""

__version__ = "0.1.0"
