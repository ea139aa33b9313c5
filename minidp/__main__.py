"""`python -m minidp`: hands over to the command line (minidp/cli.py)."""

from minidp.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
