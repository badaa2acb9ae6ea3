"""``python -m converter.cli``: the same as the ``anec`` console script."""

from converter.cli import main

# Guarded: the wheel check imports every module, and an import must not run the CLI.
if __name__ == "__main__":
    main()
