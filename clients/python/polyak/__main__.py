"""Command line: ``python -m polyak``."""

import sys


def main() -> int:
    print("polyak client", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
