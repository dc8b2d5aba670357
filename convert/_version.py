"""The package version, in a module of its own so that nothing inside the package imports the root."""

__version__ = "0.2.0"
