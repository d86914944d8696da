"""``python -m gateway``: the same command line as the ``tiergate`` console script."""

from gateway.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
