"""``python -m converter.commands``: the same as the ``anec`` console script."""

from converter.commands import main

# Guarded: the wheel check imports every module, and an import must not run the CLI.
if __name__ == "__main__":
    main()
