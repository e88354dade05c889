"""The package version, in a module of its own so that any layer can report it without importing the
public facade (kvflow/__init__.py), which sits above everything."""

__version__ = "0.1.0"
