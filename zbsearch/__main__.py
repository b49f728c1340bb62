"""``python -m zbsearch``: the command line."""

from zbsearch.app.cli import main

main()
