"""``python -m edgecloud`` runs the CLI."""

from .cli import main

main()
