"""Command line: ``python -m polyak`` (see :mod:`polyak.cli`)."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
