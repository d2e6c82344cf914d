"""The library version, in one place low in the stack (the package and saved files read it)."""

__version__ = "0.1.0"
