"""`python -m gptkit` runs the command line."""

from gptkit.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
