"""The ``flexorch`` command: :mod:`~flexorch.cli.main` parses arguments; ``plan``, ``train`` and ``profile`` are
thin layers over the solver and the control plane (:mod:`~flexorch.cli.plan`, :mod:`~flexorch.cli.train`)."""
