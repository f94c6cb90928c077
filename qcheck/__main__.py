"""``python -m qcheck``: the same as the ``qcheck`` command (:mod:`qcheck.suite.cli`)."""

import sys

from qcheck.suite.cli import main

if __name__ == "__main__":
    sys.exit(main())
