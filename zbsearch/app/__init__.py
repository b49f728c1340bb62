"""The application layer: the ``zbsearch`` command line (``cli``) and the demo (``demo``).

It only parses arguments, calls the library and prints; the demo is the one place that drives
the whole loop (profile -> solve -> replay) end to end.
"""

import sys

__all__ = ["main"]


def main() -> None:
    """The ``zbsearch`` command. Loading the command line takes a few hundred milliseconds
    (typer, pydantic, the core): a Ctrl-C in that window ends with one line, as it does later."""
    try:
        from .cli import main as run
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        raise SystemExit(130) from None
    run()
