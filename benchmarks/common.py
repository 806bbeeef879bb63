"""What every benchmark shares: the checkout's places, the results file a run writes, and the matmul peak.

Run a benchmark as a module from the repository root, ``python -m benchmarks.<folder>.<name> [options]`` (``-m``
puts the root first on ``sys.path``, so ``flexorch`` and ``benchmarks`` import from the checkout without an
install and no script patches ``sys.path``). Its printed table also lands in ``benchmarks/results/<folder>/<name>.md``
(``--results PATH`` elsewhere, ``--results -`` nowhere): :func:`run_main` does that around the script's ``main``.

Imports nothing beyond the standard library at module level (torch only inside :func:`matmul_tflops`), so the GPU
check runs it with a bare ``python3`` that has torch and no Ray.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

__all__ = [
    "BENCHMARKS",
    "RESULTS",
    "ROOT",
    "git_head",
    "gpu_results_path",
    "machine",
    "matmul_tflops",
    "results_arg",
    "results_path",
    "run_main",
    "save_hf_config",
    "start_local_ray",
    "write_report",
    "write_results",
]

BENCHMARKS = Path(__file__).resolve().parent
"""``benchmarks/``."""
ROOT = BENCHMARKS.parent
"""The repository root (the checkout)."""
RESULTS = BENCHMARKS / "results"
"""``benchmarks/results/``: the tables as they were printed, one file per benchmark."""


def results_path(name: str) -> Path:
    """``benchmarks/results/<name>.md`` for a benchmark named ``<folder>/<script>``, e.g. ``sim/planner``."""
    return RESULTS / f"{name}.md"


def results_arg(text: str) -> Path | None:
    """An argparse ``type`` for a results path: ``-`` (or an empty string) means no file."""
    return None if text in ("", "-") else Path(text)


def git_head() -> str:
    """The checkout's commit, short, with ``+changes`` when ``flexorch/`` or ``benchmarks/`` differ from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "flexorch", "benchmarks"], capture_output=True, text=True, cwd=ROOT
        )
    except OSError:
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def machine() -> str:
    """A line about where the run ran: CPUs, architecture, Python."""
    return f"{os.cpu_count()} CPUs ({platform.machine()}), {platform.system()}, Python {platform.python_version()}"


def write_results(path: Path, title: str, command: str, output: str, seconds: float) -> Path:
    """Write a run's printed output to ``path`` as markdown: a heading, when and where it ran, the command and the
    output as printed (a fenced block). Returns ``path``."""
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    body = (
        f"# {title}\n\nRun on {when} on {machine()}; flexorch at {git_head()}; {seconds:.0f} s.\n\n"
        f"```\n$ {command}\n{output.rstrip()}\n```\n"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)
    return path


def write_report(path: Path | None, text: str, raw: Path) -> None:
    """Write a benchmark's own markdown report to ``path`` (None: nowhere) and say so, naming its raw figures."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path} (raw figures: {raw})")


class _Tee(io.TextIOBase):
    """Writes to the real stream and keeps a copy."""

    def __init__(self, stream):
        self.stream, self.copy = stream, io.StringIO()

    def write(self, s: str) -> int:
        self.copy.write(s)
        return self.stream.write(s)

    def flush(self) -> None:
        self.stream.flush()

    def reconfigure(self, **kwargs) -> None:  # a benchmark asking for line buffering gets it on the real stream
        self.stream.reconfigure(**kwargs)

    def isatty(self) -> bool:
        return self.stream.isatty()


@contextlib.contextmanager
def _teed_stdout() -> Iterator[_Tee]:
    tee = _Tee(sys.stdout)
    sys.stdout = tee
    try:
        yield tee
    finally:
        sys.stdout = tee.stream


def run_main(
    main: Callable[[list[str]], int | None],
    name: str,
    default: Path | None | str = "",
    argv: Sequence[str] | None = None,
) -> int:
    """Run a benchmark's ``main(argv)`` from the command line and write what it printed to its results file.

    ``name`` is ``<folder>/<script>``; the file is ``--results PATH`` if given, else ``default`` (by default
    ``benchmarks/results/<name>.md``; None: no file unless asked); ``--results -`` writes none. ``--results`` is
    taken out of the arguments before ``main`` sees them. A run that fails (an exception or a non-zero exit) writes
    no file. Calling ``main`` directly (as a test does) writes nothing either."""
    if default == "":
        default = results_path(name)
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--results", type=results_arg, default=default)
    known, rest = pre.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    if "-h" in rest or "--help" in rest:
        try:
            return main(rest) or 0
        finally:
            print(
                f"\nresults:\n  --results PATH        write the printed output here as markdown (default "
                f"{default.relative_to(ROOT) if default else 'none here (no CUDA)'}; '-': no file)"
            )
    t0 = time.perf_counter()
    with _teed_stdout() as tee:
        code = main(rest) or 0
    if code == 0 and known.results is not None:
        module = "benchmarks." + name.replace("/", ".")
        command = shlex.join(["python", "-m", module, *rest])
        doc = " ".join((sys.modules[main.__module__].__doc__ or "").strip().split("\n\n")[0].split())
        title = f"benchmarks/{name}.py" + (f": {doc}" if doc else "")
        write_results(known.results, title, command, tee.copy.getvalue(), time.perf_counter() - t0)
        print(f"wrote {known.results}")
    return code


def gpu_results_path(name: str) -> Path | None:
    """``benchmarks/results/<name>_<gpu>.md`` (``<gpu>`` the last word of the CUDA device's name, e.g. ``h200``)
    for a GPU benchmark; None without CUDA (a dry run on the CPU writes no results file unless asked)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return RESULTS / f"{name}_{torch.cuda.get_device_name(0).split()[-1].lower()}.md"


def start_local_ray(num_cpus: int) -> None:
    """A local Ray for a measured benchmark, with ``num_cpus`` slots (one per worker actor it keeps up, and the
    driver's): no dashboard, errors only, and no worker process pre-started per slot at init (dozens of interpreters
    starting at once would load the machine during calibration)."""
    import ray

    os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, logging_level="ERROR")


def save_hf_config(own, directory: Path | str, family: str = "llama", **extra) -> None:
    """Save a Transformers config of ``family`` (default Llama) and the shape of ``own`` (a
    ``flexorch.config.ModelConfig``) to ``directory``, with ``extra`` keys (e.g. ``max_position_embeddings``) added
    or overriding: the Transformers twin of flexorch's decoder that the HF rows build."""
    import transformers

    shape = {
        "hidden_size": own.dim,
        "intermediate_size": own.ffn_dim,
        "num_hidden_layers": own.num_layers,
        "num_attention_heads": own.num_heads,
        "num_key_value_heads": own.num_kv_heads,
        "vocab_size": own.vocab_size,
        "rms_norm_eps": own.norm_eps,
        "rope_theta": own.rope_theta,
        "tie_word_embeddings": own.tie_embeddings,
    }
    transformers.AutoConfig.for_model(family, **{**shape, **extra}).save_pretrained(directory)


def matmul_tflops(device, n: int = 8192, warmup: int = 3, reps: int = 10) -> float | None:
    """The bf16 rate of an ``n`` x ``n`` matmul on a CUDA ``device`` in TFLOP/s (``reps`` back to back after
    ``warmup``, timed whole); None on any other device."""
    import torch

    if device.type != "cuda":
        return None
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(warmup):
        a @ a
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ a
    torch.cuda.synchronize(device)
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e12
