"""``python -m ggufkit``."""

from ggufkit.cli import main

main()
