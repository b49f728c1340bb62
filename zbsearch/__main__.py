"""``python -m zbsearch``: the command line."""

from zbsearch.app import main

main()
