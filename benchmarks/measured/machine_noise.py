"""How steadily this machine runs a fixed piece of work (a benchmark, not a test): the floor under any step prediction.

Issue 48 asks the demo's step predictions to be within 5 % (median) and 15 % (worst). A prediction cannot beat the
machine: if the same work takes a different time from one step to the next, no cost model knows which. This runs
``processes`` copies of the same single-threaded compute at once (as a run's CPU workers share the cores), each
timing ``chunks`` equal chunks of float32 matmuls sized to take ``chunk_s`` of CPU alone, and reports how far the
chunks lie from their median: the spread a step of that length has before flexorch plans anything.

    python -m benchmarks.measured.machine_noise                      # 4 processes, 0.7 s chunks (the demo's share)
    python -m benchmarks.measured.machine_noise --processes 1        # alone: the machine's quiet spread

``benchmarks/measured/calibration_error.py --runs`` runs it after the demo, with chunks of the demo's step.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import numpy as np

from benchmarks.common import run_main

_CHUNKS = """
import sys, time, torch
torch.set_num_threads(1)
a, b = torch.randn(256, 256), torch.randn(256, 256)
n, chunks = int(sys.argv[1]), int(sys.argv[2])
for _ in range(chunks):
    t = time.perf_counter()
    for _ in range(n):
        a @ b
    print(time.perf_counter() - t, flush=True)
"""


def _matmuls_per_second() -> float:
    """How many 256x256 float32 matmuls one thread does per second here, alone (timed in a child process)."""
    out = subprocess.run([sys.executable, "-c", _CHUNKS, "400", "3"], capture_output=True, text=True, check=True)
    return 400 / min(float(x) for x in out.stdout.split())


def machine_noise(processes: int, chunk_s: float, chunks: int = 8) -> dict:
    """Chunk times of ``processes`` processes at once, each ``chunks`` chunks of ``chunk_s`` CPU seconds alone;
    the first and last chunk of each process are left out (the others start or stop beside it). Returns the median
    and the worst |chunk / median - 1| over all chunks, and the chunks' median wall time (s)."""
    if processes < 1 or chunk_s <= 0 or chunks < 3:
        raise ValueError(f"need processes >= 1, chunk_s > 0, chunks >= 3; got {processes}, {chunk_s}, {chunks}")
    n = max(1, round(chunk_s * _matmuls_per_second()))
    procs = [
        subprocess.Popen([sys.executable, "-c", _CHUNKS, str(n), str(chunks)], stdout=subprocess.PIPE, text=True)
        for _ in range(processes)
    ]
    times = []
    for p in procs:
        out, _ = p.communicate()
        if p.returncode:
            raise RuntimeError(f"a noise process failed with exit code {p.returncode}")
        times += [float(x) for x in out.split()][1:-1]
    t = np.asarray(times)
    dev = np.abs(t / np.median(t) - 1)
    return {"processes": processes, "chunk_s": chunk_s, "median_wall_s": float(np.median(t)), "chunks": int(t.size),
            "median": float(np.median(dev)), "worst": float(dev.max())}  # fmt: skip


def describe(noise: dict) -> str:
    return (
        f"machine: {noise['processes']} processes at once on {os.cpu_count()} cores, each timing equal chunks of "
        f"{noise['chunk_s']:.2f} CPU-s of matmuls ({noise['median_wall_s'] * 1e3:.0f} ms a chunk shared): "
        f"{noise['chunks']} chunks lie a median {100 * noise['median']:.1f} % and at most "
        f"{100 * noise['worst']:.1f} % from their median"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", type=int, default=4, help="processes at once (default 4: the demo's workers)")
    ap.add_argument("--chunk-s", type=float, default=0.7, help="CPU seconds of one chunk alone (default 0.7)")
    ap.add_argument("--chunks", type=int, default=10, help="chunks per process (default 10)")
    args = ap.parse_args(argv)
    print(describe(machine_noise(args.processes, args.chunk_s, args.chunks)))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_main(main, "measured/machine_noise"))
