"""``python -m converter.cli``: the same as the ``anec`` console script."""

from converter.cli import main

main()
