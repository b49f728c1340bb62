"""Run the zbsearch command line from a checkout: ``python cli.py --help``.

Installed, the same command is ``zbsearch`` (or ``python -m zbsearch``); this file only makes a
checkout usable without installing and is not part of the package.
"""

from zbsearch.app import main

if __name__ == "__main__":
    main()
