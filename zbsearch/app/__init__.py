"""The application layer: the ``zbsearch`` command line (``cli``) and the demo (``demo``).

It only parses arguments, calls the library and prints; the demo is the one place that drives
the whole loop (profile -> solve -> replay) end to end.
"""
