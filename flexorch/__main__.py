"""``python -m flexorch`` is the ``flexorch`` command, with its exit status (2 on an error, 130 on Ctrl-C)."""

import sys

from flexorch.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
