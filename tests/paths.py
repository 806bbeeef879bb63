"""Named places of the checkout for the tests, so a test module finds data the same way whichever level folder
(``tests/unit``, ``tests/integration``, ``tests/cluster``, ``tests/gpu``) it sits in: no ``Path(__file__)``
arithmetic in test modules."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
"""``tests/``: the shared helpers, ``conftest.py`` and the level folders."""
REPO = TESTS.parent
"""The repository root (the checkout): ``PYTHONPATH`` and ``cwd`` of subprocesses that import ``flexorch``/``tests``."""
PACKAGE = REPO / "flexorch"
"""The ``flexorch`` package's source."""
DATA = TESTS / "data"
"""Recorded runs and plans the viewer, refit and step-level tests read (``recorded_run``, ``demo_refit``, ...)."""
EXAMPLES = REPO / "examples"
"""The example run files and profiles (``examples/*.toml``, ``examples/profiles``)."""
BENCHMARKS = REPO / "benchmarks"
"""The benchmark scripts some smoke tests load."""
