"""``python -m llamamesh.cli``: the ``llamamesh`` command."""

from llamamesh.cli import main

main()
