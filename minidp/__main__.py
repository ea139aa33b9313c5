"""`python -m minidp`: hands over to the command line (minidp/cli/commands.py)."""

from minidp.cli.commands import main

if __name__ == "__main__":
    raise SystemExit(main())
