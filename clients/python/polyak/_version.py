"""The client's version, in a leaf module so that every layer may name it
(the package's ``__init__`` re-exports it)."""

__version__ = "0.1.0"

#: What every request of this client says it is.
USER_AGENT = f"polyak-python/{__version__}"
