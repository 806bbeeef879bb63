"""``python -m flexorch`` is the ``flexorch`` command."""

from flexorch.cli.main import main

if __name__ == "__main__":
    main()
