"""The prepared corpus store at scale: preparing it, starting on it, the driver's memory and the workers' reads.

Corpora: JSONL files of ``{"text": ...}`` records that this script generates (and reuses from ``--workdir`` on the
next run): ``30M``, ``300M`` and ``1.2B`` tokens (byte tokenizer: a token per UTF-8 byte plus a BOS per document)
with Wikipedia's document lengths (the bundled ``wikipedia_lengths_100k.txt``, FlexSP's release; documents over
``max_context`` = 2048 tokens are split into pieces as in a run), filled with pseudo-random words of a Zipf-like
vocabulary; and ``short3M``: 3,000,000 records of ~60 bytes (with ``short30K``, 30,000 such records, made for the
memory comparison). Per corpus, side by side in one run:

1. prepare: ``prepare_store`` with every CPU of the Ray cluster (the default: line-aligned work units, one task
   each) against one task for the whole file (``unit_bytes=1<<62, parallelism=1``: the old behaviour), the byte
   tokenizer; and the same pair with a byte-level BPE (trained once with ``flexorch.data.bpe.train_bpe`` on the
   corpus's first 8 MB, used as ``tokenizer = 'hf:<dir>'``) on the ``--bpe-on`` corpus only (300M by default: BPE
   prepares are slow; ``--bpe-on 1.2B`` adds ~25 minutes). One Ray (``ray.init(num_cpus=<cores>)``, workers at
   niceness 0 as ``flexorch train`` starts them) serves every prepare; a tiny warm-up prepare first starts its
   workers, Ray Data and the tokenizer in each worker. The source file is read once before each pair (both modes
   find it in the page cache), each prepare starts from an empty store directory, and each pair runs
   ``--repeats`` rounds (2), the order alternating. Seconds: the wall time of ``prepare_store`` (plan, tasks,
   index merge, manifest), the median of the rounds; tokens/s = tokens / seconds; the share of the machine's
   cores busy meanwhile (``/proc/stat``, any process: others' work on a shared machine shows there too) and its
   1-minute load average just before.
2. start on the prepared store: ``load_corpus`` timed in a fresh process on the ``[data] cache`` the prepare wrote
   (what a second ``flexorch train``, a ``--resume`` and a restarted driver all do in ``TrainingDriver.setup``);
   and real ``flexorch train --steps 2 --workers 2`` runs with a fixed profile
   (``benchmarks/measured/fixed_profile.py``: no calibration) on the ``--train-on`` corpora: a first run, a second
   run (new run dir), a ``--resume`` of the second to step 3, and a run whose driver actor is SIGKILLed after its
   first step (the CLI starts a new driver from the last checkpoint); reported: the corpus time each prints ("opened
   the corpus store: ... in X s"; the new driver's "(corpus X s)" in its recovery line) and the second run's wall
   time from launch to its first step.
3. the driver's resident memory: in the same fresh process, VmRSS (and its anonymous / file-backed split,
   ``/proc/self/status``) before a second ``load_corpus`` (the first loaded the modules it imports) and after it
   plus a ``DocumentStream`` of batch 512, ``locate()`` of 20 batches and the planner's lookahead lengths
   (``corpus.lengths[next batch]``) as the driver does; bytes per document, and the growth
   (rss(short3M) - rss(short30K)) / (3M - 30K) documents.
4. per-step data time on a worker: in that fresh process, after the memory is taken, the wall time of
   ``fetch_documents(open_blocks(corpus.block_specs(loc.block for loc in locs)), locs)`` for 20 batches of 16
   and of 512 random documents each: the median, the first batch (it opens the blocks), and the median of the
   same batches read again (a worker checks each 1 MiB chunk against its digest the first time it reads it, once
   per process).

Prints the tables (markdown) with the machine, date, command and flexorch's commit, and writes them to
``--results`` (default ``benchmarks/results/measured/data_scale.md``; ``-``: no file); the raw figures go to
``<workdir>/results.json``. Stores and runs stay in ``--workdir`` (~6 GB).

    python -m benchmarks.measured.data_scale --quick   # 3M tokens + 30K/300K short records: a smoke run, 3-6 minutes
    python -m benchmarks.measured.data_scale           # everything: ~25 minutes on 2 cores
    python -m benchmarks.measured.data_scale --sizes 30M,short3M --train-on 30M --bpe-on 30M
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import ROOT, results_arg, write_report  # noqa: E402
from benchmarks.common import results_path as results_file  # noqa: E402

SHORT_BYTES = (40, 80)
"""Text bytes of a ``short<N>`` record: uniform in [40, 80] (~60)."""
WORD_BUFFER_BYTES = 48 << 20
"""Bytes of pseudo-random words documents are cut from (at random offsets)."""
MAX_CONTEXT = 2048
BATCHES = 20
LOOKAHEAD_BATCH = 512
MB = 1e6


# --------------------------------------------------------------------------------------------------- the corpora
def parse_size(name: str) -> dict:
    """'30M' -> 30e6 tokens of Wikipedia-like documents; 'short3M' -> 3e6 records of ~60 bytes."""
    m = re.fullmatch(r"(short)?([0-9]+(?:\.[0-9]+)?)([KMB]?)", name)
    if not m:
        raise argparse.ArgumentTypeError(f"a size is like 30M, 1.2B or short3M, got {name!r}")
    n = int(round(float(m[2]) * {"": 1, "K": 1e3, "M": 1e6, "B": 1e9}[m[3]]))
    return {"name": name, "short": bool(m[1]), "docs" if m[1] else "tokens": n}


def _lengths_pool() -> tuple[np.ndarray, str]:
    """Document lengths (bytes) to sample from: the bundled Wikipedia file, else the shared one, else a long tail."""
    try:
        from flexorch.data.lengths import bundled_lengths_path, read_lengths

        path = bundled_lengths_path()
        if path.is_file():
            return read_lengths(path), "Wikipedia (flexorch/data/bundled/wikipedia_lengths_100k.txt)"
    except Exception:  # noqa: BLE001 - fall back below
        pass
    shared = ROOT.parent / "shared" / "data" / "wikipedia_lengths.txt"
    if shared.is_file():
        return np.loadtxt(shared, dtype=np.int64), f"Wikipedia ({shared})"
    rng = np.random.default_rng(7)  # lognormal, median ~350 B, mean ~1000 B, capped at 100K
    pool = np.minimum(rng.lognormal(np.log(350), 1.45, 200_000), 100_000).astype(np.int64)
    return pool, "lognormal (median 350 B, mean ~1000 B, capped at 100 KB)"


def _word_buffer(rng: np.random.Generator, nbytes: int) -> bytes:
    """Space-separated pseudo-random words (a 20K-word vocabulary, Zipf-like frequencies), ``nbytes`` or more."""
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)
    n_words = 20_000
    word_len = np.clip(rng.geometric(0.22, n_words), 1, 14)
    words = [letters[rng.integers(0, 26, k)].tobytes() for k in word_len]
    p = 1.0 / (np.arange(n_words) + 8.0)
    p /= p.sum()
    mean = float((word_len * p).sum()) + 1
    idx = rng.choice(n_words, size=int(nbytes / mean * 1.05) + 1, p=p)
    return b" ".join([words[i] for i in idx])


def generate(spec: dict, workdir: Path, seed: int = 0) -> dict:
    """Write the corpus of ``spec`` to ``<workdir>/corpora/<name>.jsonl`` (reused when its notes match)."""
    out = workdir / "corpora" / f"{spec['name']}.jsonl"
    notes_path = out.with_suffix(".json")
    want = {k: spec[k] for k in ("name", "short", "docs", "tokens") if k in spec} | {"seed": seed, "version": 1}
    if out.is_file() and notes_path.is_file():
        notes = json.loads(notes_path.read_text())
        if notes.get("want") == want and notes.get("bytes") == out.stat().st_size:
            return notes
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rng = np.random.default_rng([seed, len(spec["name"]), sum(spec["name"].encode())])
    buf = _word_buffer(rng, WORD_BUFFER_BYTES)
    if spec["short"]:
        lengths = rng.integers(SHORT_BYTES[0], SHORT_BYTES[1] + 1, spec["docs"])
        source = f"uniform {SHORT_BYTES[0]}-{SHORT_BYTES[1]} bytes"
    else:
        pool, source = _lengths_pool()
        pool = pool[pool > 0]
        chunks, total = [], 0
        while total < spec["tokens"]:
            draw = rng.choice(pool, 1 << 16)
            chunks.append(draw)
            total += int((draw + 1).sum())
        lengths = np.concatenate(chunks)
        cum = np.cumsum(lengths + 1)
        lengths = lengths[: int(np.searchsorted(cum, spec["tokens"])) + 1]
    starts = rng.integers(0, len(buf) - int(lengths.max()) - 1, len(lengths))
    tmp = out.with_name(f".{out.name}.tmp")
    with open(tmp, "wb", buffering=16 << 20) as f:
        write = f.write
        for s, n in zip(starts.tolist(), lengths.tolist(), strict=True):
            write(b'{"text": "%s"}\n' % buf[s : s + n])
    os.replace(tmp, out)
    notes = {
        "want": want,
        "path": str(out),
        "records": int(len(lengths)),
        "text_bytes": int(lengths.sum()),
        "byte_tokens": int((lengths + 1).sum()),
        "bytes": out.stat().st_size,
        "lengths": source,
        "generate_s": round(time.perf_counter() - t0, 1),
    }
    notes_path.write_text(json.dumps(notes, indent=1))
    print(
        f"generated {out}: {notes['records']:,} records, {notes['bytes'] / MB:,.1f} MB in {notes['generate_s']} s",
        flush=True,
    )
    return notes


def _warm(path: str) -> None:
    """Read the file once: both prepares of a pair find it in the page cache."""
    with open(path, "rb", buffering=0) as f:
        while f.read(64 << 20):
            pass


# ------------------------------------------------------------------------------------------------------- prepare
def store_dir(cfg, cache: Path) -> Path:
    from flexorch.data.listing import list_source
    from flexorch.data.record_kinds import resolve_kind
    from flexorch.data.store.fingerprint import fingerprints

    listing = list_source(cfg)
    return cache / fingerprints(cfg, listing, resolve_kind(listing, cfg))["key"]


def _cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of every CPU of the machine (/proc/stat): any process's work counts, others' too."""
    vals = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = vals[3] + vals[4]  # idle + iowait
    return sum(vals) - idle, sum(vals)


def _prepare_once(cfg, out: Path, say, kw: dict, label: str) -> dict:
    from flexorch.data.store.prepare import prepare_store

    shutil.rmtree(out, ignore_errors=True)
    load = os.getloadavg()[0]
    print(f"  prepare {Path(cfg.source).name} ({cfg.tokenizer}), {label}; load {load:.1f}", flush=True)
    t0, c0, (b0, j0) = time.perf_counter(), time.process_time(), _cpu_jiffies()
    try:
        m = prepare_store(cfg, out, say, **kw)
    except Exception as e:  # noqa: BLE001 - reported as it is, never worked around
        res = {"error": f"{type(e).__name__}: {e}", "s": round(time.perf_counter() - t0, 1), "loadavg_before": load}
        print(f"  FAILED after {res['s']} s: {res['error']}", flush=True)
        return res
    dt, (b1, j1) = time.perf_counter() - t0, _cpu_jiffies()
    return {
        "machine_busy": (b1 - b0) / max(1, j1 - j0),  # the share of all cores busy while it ran (any process)
        "driver_cpu_s": time.process_time() - c0,  # this process: Ray Data's executor, the index merge
        "s": round(dt, 2),
        "tokens": int(m["tokens"]),
        "documents": int(m["documents"]),
        "parts": len(m["parts"]),
        "tokens_per_s": m["tokens"] / dt,
        "store_bytes": int(sum(p["bytes"] for p in m["parts"])),
        "tasks_s": m["stats"].get("prepare_s"),  # the unit tasks alone; the rest: plan, merge, manifest
        "loadavg_before": load,
    }


def prepare_pair(cfg, keep: Path | None, scratch: Path, say, repeats: int = 1) -> dict:
    """One task on the whole file and every CPU, ``repeats`` rounds (the order alternating: one task first in
    round 1): per mode the median seconds and its tokens/s; ``speedup``: their ratio. The all-CPU store is kept in
    ``keep`` (the cache path a run looks in) when given; the rest is removed."""
    _warm(cfg.source)
    modes = {
        "one_task": (scratch / "one-task", {"parallelism": 1, "unit_bytes": 1 << 62}),
        "all_cpus": (keep or scratch / "all-cpus", {}),
    }
    rounds = []
    for r in range(repeats):
        order = ["one_task", "all_cpus"] if r % 2 == 0 else ["all_cpus", "one_task"]
        got = {}
        for name in order:
            out, kw = modes[name]
            got[name] = _prepare_once(cfg, out, say, kw, f"{name.replace('_', ' ')}, round {r + 1}/{repeats}")
            if out != keep:
                shutil.rmtree(out, ignore_errors=True)
        if all("tokens_per_s" in got[m] for m in modes):
            got["speedup"] = got["all_cpus"]["tokens_per_s"] / got["one_task"]["tokens_per_s"]
        rounds.append(got)
    res: dict = {"rounds": rounds}
    for name in modes:
        ok = [g[name] for g in rounds if "tokens_per_s" in g[name]]
        if len(ok) < len(rounds):
            res[name] = next(g[name] for g in rounds if "error" in g[name])
            continue
        s = statistics.median(g["s"] for g in ok)
        res[name] = dict(ok[0]) | {
            "s": s,
            "tokens_per_s": ok[0]["tokens"] / s,
            "all_s": [g["s"] for g in ok],
            "loadavg_before": [g["loadavg_before"] for g in ok],
            "machine_busy": [g["machine_busy"] for g in ok],
            "driver_cpu_s": [g["driver_cpu_s"] for g in ok],
        }
    if all("tokens_per_s" in res[m] for m in modes):
        res["speedup"] = res["all_cpus"]["tokens_per_s"] / res["one_task"]["tokens_per_s"]
    return res


def warm_up(cfg, scratch: Path) -> None:
    """Start Ray's workers and Ray Data, and load the tokenizer in every worker (the import of transformers for a
    BPE: seconds), before any timed prepare: a tiny corpus in one task, then in 16 KB units over every CPU."""
    from flexorch.data.store.prepare import prepare_store

    for i, kw in enumerate(({"parallelism": 1, "unit_bytes": 1 << 62}, {"unit_bytes": 16 << 10})):
        shutil.rmtree(scratch / str(i), ignore_errors=True)
        prepare_store(cfg, scratch / str(i), None, **kw)
        shutil.rmtree(scratch / str(i), ignore_errors=True)


def bpe_tokenizer(cfg, workdir: Path, vocab: int) -> tuple[str, dict]:
    from flexorch.data.bpe import train_bpe

    out = workdir / "tokenizers" / f"bpe-{vocab}-{Path(cfg.source).stem}"
    meta = out / "flexorch_bpe.json"
    if not meta.is_file():
        info = train_bpe(cfg, vocab, out)
        print(f"  trained bpe:{vocab} on {info['sample_bytes'] / MB:.1f} MB in {info['seconds']:.1f} s", flush=True)
    return f"hf:{out}", json.loads(meta.read_text())


# ------------------------------------------------------------------------------- the fresh process: start/memory/reads
def _status() -> dict:
    """VmRSS, RssAnon and RssFile of this process, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def probe(args: dict) -> dict:
    """Run in a fresh process: time load_corpus on the prepared cache, the driver's memory, the workers' reads."""
    from flexorch.config.data import CorpusConfig
    from flexorch.data import corpus as corpus_mod
    from flexorch.data.listing import list_source  # noqa: F401 - imported before the baseline is taken
    from flexorch.data.record_kinds import resolve_kind  # noqa: F401
    from flexorch.data.store import blocks, fingerprint, layout, prepare  # noqa: F401
    from flexorch.data.stream import DocumentStream

    cfg = CorpusConfig(source=args["source"], tokenizer="byte", max_context=MAX_CONTEXT, cache=args["cache"])
    t0 = time.perf_counter()
    corpus = corpus_mod.load_corpus(cfg)  # a fresh process: its lazy imports included, as in a new driver
    load_s = time.perf_counter() - t0
    del corpus
    gc.collect()
    before = _status()  # the modules load_corpus imports are loaded now: what follows is the corpus's own memory
    t0 = time.perf_counter()
    corpus = corpus_mod.load_corpus(cfg)
    load_again_s = time.perf_counter() - t0
    opened = _status()
    stream = DocumentStream(corpus.num_docs, LOOKAHEAD_BATCH, seed=0)
    for _ in range(BATCHES):
        batch = stream.next_batch()
        lengths = [int(x) for x in corpus.lengths[list(batch.doc_ids)]]
        corpus.locate(list(batch.doc_ids))
        nxt = stream.peek()
        lookahead = [int(x) for x in corpus.lengths[list(nxt.doc_ids)]]
    del lengths, lookahead
    after = _status()
    reads = {}
    for bs in (16, 512):
        rng = np.random.default_rng(bs)
        batches = [
            corpus.locate(rng.choice(corpus.num_docs, min(bs, corpus.num_docs), replace=False)) for _ in range(BATCHES)
        ]
        times, again = [], []
        for out in (times, again):  # again: the same batches, their chunks already checked in this process
            for locs in batches:
                t = time.perf_counter()
                specs = corpus.block_specs(loc.block for loc in locs)
                docs = blocks.fetch_documents(blocks.open_blocks(specs), locs)
                out.append((time.perf_counter() - t) * 1e3)
                assert len(docs) == len(locs)
        reads[str(bs)] = {
            "median_ms": statistics.median(times),
            "first_ms": times[0],
            "max_ms": max(times),
            "again_median_ms": statistics.median(again),
        }
    return {
        "documents": corpus.num_docs,
        "tokens": corpus.total_tokens,
        "store": corpus.store,
        "load_s": load_s,
        "load_again_s": load_again_s,
        "rss_before": before,
        "rss_opened": opened,
        "rss_after": after,
        "driver_bytes": after["VmRSS"] - before["VmRSS"],
        "driver_anon": after["RssAnon"] - before["RssAnon"],
        "driver_file": after["RssFile"] - before["RssFile"],
        "reads": reads,
    }


def run_probe(source: str, cache: Path) -> dict:
    probe = json.dumps({"source": source, "cache": str(cache)})
    cmd = [sys.executable, "-m", "benchmarks.measured.data_scale", "--probe", probe]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE ")]
    if proc.returncode or not lines:
        return {"error": (proc.stderr.strip().splitlines() or ["(no output)"])[-1]}
    return json.loads(lines[-1][6:])


# ------------------------------------------------------------------------------------------- real `flexorch train`
_CORPUS_LINE = re.compile(r"(opened the corpus store|loaded the corpus|opened the prepared corpus): .* in ([0-9.]+) s")


_RESTART_LINE = re.compile(
    r"driver restarted, recovered in ([0-9.]+) s: .*new driver ([0-9.]+) s \(corpus ([0-9.]+) s\)"
)


def _kill_driver(pid: int) -> int | None:
    """SIGKILL the driver actor's process among the descendants of ``pid`` (this run's own local Ray)."""
    import psutil

    for child in psutil.Process(pid).children(recursive=True):
        try:
            if any("ray::TrainingDriver" in part for part in child.cmdline()):
                child.kill()
                return child.pid
        except psutil.Error:
            continue
    return None


def train_once(
    source: str,
    run_dir: Path,
    cache: Path,
    profile: Path,
    steps: int,
    resume: bool = False,
    kill_driver: bool = False,
    extra: tuple = (),
) -> dict:
    """One ``flexorch train`` subprocess: its corpus line and seconds, and the wall time to its first step line.
    ``kill_driver``: SIGKILL the driver actor once the first step is printed; the CLI starts a new one from the
    last checkpoint, whose corpus time its recovery line gives."""
    cmd = [sys.executable, "-m", "flexorch", "train", "--data", source, "--steps", str(steps), "--workers", "2"]
    cmd += ["--run-dir", str(run_dir), "--profile", str(profile)] + (["--resume"] if resume else []) + list(extra)
    env = dict(os.environ, FLEXORCH_DATA_CACHE=str(cache), PYTHONUNBUFFERED="1")
    t0 = time.monotonic()
    res = {"command": shlex.join(["flexorch", *cmd[3:]]), "corpus_s": None, "first_step_s": None, "corpus_line": None}
    tail: list[str] = []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    try:
        for line in proc.stdout:
            line = line.rstrip()
            tail = (tail + [line])[-15:]
            m = _CORPUS_LINE.search(line)
            if m and res["corpus_s"] is None:
                res["corpus_s"], res["corpus_line"], res["corpus_at_s"] = float(m[2]), line, time.monotonic() - t0
                res["prepared"] = m[1] == "loaded the corpus"
            if re.match(r"step\s+\d+/", line) and res["first_step_s"] is None:
                res["first_step_s"] = time.monotonic() - t0
                if kill_driver:
                    res["killed_driver_pid"] = _kill_driver(proc.pid)
            m = _RESTART_LINE.search(line)
            if m and "restart_corpus_s" not in res:
                res["restart_total_s"], res["restart_new_driver_s"] = float(m[1]), float(m[2])
                res["restart_corpus_s"], res["restart_line"] = float(m[3]), line
        proc.wait(timeout=900)
    except subprocess.TimeoutExpired:
        proc.kill()
    res["rc"], res["wall_s"] = proc.returncode, time.monotonic() - t0
    if proc.returncode:
        res["error"] = " | ".join(tail[-4:])
    return res


def train_runs(name: str, source: str, workdir: Path, cache: Path, profile: Path) -> dict:
    runs = workdir / "runs"
    for d in ("first", "second", "restart"):
        shutil.rmtree(runs / f"{name}-{d}", ignore_errors=True)
    out = {}
    for label, run_dir, steps, resume, kill, extra in (
        ("first", runs / f"{name}-first", 2, False, False, ()),
        ("second", runs / f"{name}-second", 2, False, False, ()),
        ("resume", runs / f"{name}-second", 3, True, False, ()),
        ("restart", runs / f"{name}-restart", 6, False, True, ("--checkpoint-every", "1")),
    ):
        print(f"  flexorch train on {name}: {label} run", flush=True)
        out[label] = r = train_once(source, run_dir, cache, profile, steps, resume, kill, extra)
        restart = (
            f", driver killed (pid {r.get('killed_driver_pid')}), the new driver's corpus {r.get('restart_corpus_s')} s"
            if kill
            else ""
        )
        print(
            f"    rc {r['rc']}, corpus {r['corpus_s']} s, first step at {_f(r['first_step_s'])}"
            f" s, wall {r['wall_s']:.1f} s{restart}" + (f"; {r['error']}" if r.get("error") else ""),
            flush=True,
        )
    return out


# ------------------------------------------------------------------------------------------------------- report
def _f(x, fmt: str = "{:,.1f}", none: str = "–") -> str:
    return none if x is None else fmt.format(x)


def _busy(r: dict | None) -> str:
    v = (r or {}).get("machine_busy")
    return "–" if not v else ", ".join(f"{x:.0%}" for x in (v if isinstance(v, list) else [v]))


def _loads(r: dict | None) -> str:
    v = (r or {}).get("loadavg_before")
    return "–" if v is None else ", ".join(f"{x:.1f}" for x in (v if isinstance(v, list) else [v]))


def _reads(r: dict) -> str:
    again = f" / {r['again_median_ms']:.2f}" if "again_median_ms" in r else ""
    return f"{r['median_ms']:.2f} ({r['first_ms']:.1f}){again}"


def _rate(r: dict | None) -> str:
    if not r:
        return "–"
    if r.get("error"):
        return f"failed after {r['s']} s"
    each = f" [{', '.join(f'{x:,.1f}' for x in r['all_s'])}]" if len(r.get("all_s", ())) > 1 else ""
    return f"{r['s']:,.1f} s{each} ({r['tokens_per_s'] / 1e6:.2f}M/s)"


def report(results: dict, args, command: str) -> str:
    cores = os.cpu_count()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    cpu = platform.processor() or platform.machine()
    lines = [
        "# benchmarks/measured/data_scale.py: the prepared corpus store at scale (prepare, start, driver memory, "
        "worker reads)",
        "",
        f"Run on {time.strftime('%Y-%m-%d')} on this machine: {cores} CPU cores ({cpu}), {mem:.0f} GiB, shared with "
        "other work; Ray started once with every core for the prepares. Byte tokenizer unless said; `max_context` "
        f"{MAX_CONTEXT} (longer documents split into pieces, as a run does). Document lengths: "
        f"{results.get('lengths_source', '?')}; text: pseudo-random words.",
        "",
        "```",
        f"$ {command}",
        "```",
        "",
        f"flexorch at {results.get('code')}"
        + (
            f" (at the end: {results.get('code_after')}: the code changed during the run)"
            if results.get("code_after") not in (None, results.get("code"))
            else ""
        )
        + ".",
        "",
        "## Prepare: every CPU (work units) vs one task on the whole file, side by side",
        "",
        "Seconds: the wall time of `prepare_store`, the median of the rounds [each round's], one task first in "
        "odd rounds and every CPU first in even ones; tokens/s = tokens / median seconds; speedup: the ratio of "
        "the two. Load: the machine's 1-minute load average just before each prepare (one task / every CPU); "
        "other work shares this machine and its load is outside this benchmark's control. Busy: the share of the "
        "machine's cores busy while it ran (/proc/stat; any process, this benchmark's Ray and others' work alike).",
        "",
        "| corpus | tokenizer | records | documents | tokens | JSONL MB | one task | every CPU (blocks) | speedup "
        "| load | busy |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results["corpora"].items():
        for tok_label, key in (("byte", "prepare"), (r.get("bpe_label"), "prepare_bpe")):
            p = r.get(key)
            if not p:
                continue
            ok = p.get("all_cpus", {}) if "tokens" in p.get("all_cpus", {}) else p.get("one_task", {})
            parts = f" ({p['all_cpus']['parts']})" if "parts" in p.get("all_cpus", {}) else ""
            lines.append(
                f"| {name} | {tok_label} | {r['gen']['records']:,} | {_f(ok.get('documents'), '{:,}')} | "
                f"{_f(ok.get('tokens'), '{:,}')} | {r['gen']['bytes'] / MB:,.0f} | {_rate(p.get('one_task'))} | "
                f"{_rate(p.get('all_cpus'))}{parts} | {_f(p.get('speedup'), '{:.2f}x')} | "
                f"{_loads(p.get('one_task'))} / {_loads(p.get('all_cpus'))} | "
                f"{_busy(p.get('one_task'))} / {_busy(p.get('all_cpus'))} |"
            )
    lines += [
        "",
        "## Starting on the prepared store, the driver's memory, the workers' reads",
        "",
        "`load_corpus` s: a fresh process opening the store from `[data] cache`, its lazy imports included (the "
        "path of a second `flexorch "
        "train`, a `--resume` and a restarted driver: `TrainingDriver.setup`). `train #2`: a second real "
        "`flexorch train --steps 2 --workers 2` (fixed profile) on the corpus: the corpus time the driver prints / "
        "wall time from launch to its first step line (Ray, worker and model start included); `resume`: the corpus "
        "time of a `--resume` of that run; `restart`: a run (`--steps 6 --checkpoint-every 1`) whose driver actor is "
        "SIGKILLed after its first step: the corpus time of the new driver the CLI starts (its recovery line). "
        "Driver memory: VmRSS growth of the fresh process over `load_corpus` + a "
        "`DocumentStream` (batch 512) + `locate()` of 20 batches + the lookahead lengths (anonymous + file-backed "
        "pages of the memory-mapped index), measured over a second `load_corpus` in that process (the first one "
        "loaded the modules it imports). Worker reads: "
        "`fetch_documents(open_blocks(block_specs(blocks of locs)), locs)` "
        "of 20 random batches in a fresh process (16-doc batches first): the median ms (the first batch's: it "
        "opens the blocks) / the median when the same 20 batches are read again (their 1 MiB chunks already checked "
        "against their digests: a worker checks each chunk once per process).",
        "",
        "| corpus | documents | `load_corpus` s | train #2: corpus s / first step s | resume: corpus s | restart: "
        "corpus s | driver RSS MB (anon + file) | bytes/doc | read 16 docs ms: median (first) / again | "
        "read 512 docs ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results["corpora"].items():
        pr = r.get("probe") or {}
        if pr.get("error"):
            lines.append(f"| {name} | probe failed: {pr['error']} ||||||||")
            continue
        if not pr:
            continue
        tr = r.get("train") or {}
        second, resume, restart = tr.get("second") or {}, tr.get("resume") or {}, tr.get("restart") or {}
        restart_col = (
            _f(restart.get("restart_corpus_s"))
            if restart.get("restart_corpus_s") is not None
            else ("failed" if restart.get("error") else ("no restart seen" if restart else "–"))
        )
        train_col = (
            f"{_f(second.get('corpus_s'))} / {_f(second.get('first_step_s'))}"
            if second and not second.get("error")
            else ("failed" if second else "–")
        )
        rd = pr["reads"]
        lines.append(
            f"| {name} | {pr['documents']:,} | {pr['load_s']:.3f} | {train_col} | "
            f"{_f(resume.get('corpus_s')) if resume and not resume.get('error') else ('failed' if resume else '–')} | "
            f"{restart_col} | "
            f"{pr['driver_bytes'] / 2**20:,.1f} ({pr['driver_anon'] / 2**20:,.1f} + "
            f"{pr['driver_file'] / 2**20:,.1f}) | "
            f"{pr['driver_bytes'] / pr['documents']:.1f} | {_reads(rd['16'])} | "
            f"{_reads(rd['512'])} |"
        )
    lines += ["", "## Against the bars", ""] + [f"- {b}" for b in verdicts(results)]
    fails = [
        (n, lbl, t)
        for n, r in results["corpora"].items()
        for lbl, t in (r.get("train") or {}).items()
        if t.get("error")
    ]
    for n, lbl, t in fails:
        lines.append(f"- `flexorch train` on {n} ({lbl} run) failed (rc {t['rc']}): {t['error']}")
    lines.append("")
    return "\n".join(lines)


def verdicts(results: dict) -> list[str]:
    out = []
    corp = results["corpora"]
    for name, r in corp.items():
        for key, what in (("prepare", "byte tokenizer"), ("prepare_bpe", r.get("bpe_label"))):
            p = r.get(key)
            if not p or r["spec"]["short"]:
                continue
            if p.get("speedup") is None:
                errs = "; ".join(f"{k}: {v['error']}" for k, v in p.items() if isinstance(v, dict) and v.get("error"))
                out.append(f"prepare {name} ({what}): no ratio ({errs or 'missing'})")
                continue
            bar = "PASS" if p["speedup"] >= 1.7 else "FAIL"
            each = [f"{g['speedup']:.2f}x" for g in p.get("rounds", ()) if "speedup" in g]
            out.append(
                f"prepare {name} ({what}): every CPU {p['all_cpus']['tokens_per_s'] / 1e6:.2f}M tokens/s vs one task "
                f"{p['one_task']['tokens_per_s'] / 1e6:.2f}M tokens/s = {p['speedup']:.2f}x (rounds: "
                f"{', '.join(each)}; bar >= 1.7x on the 1.2B corpus: {bar if name == '1.2B' else 'for reference'})"
            )
    starts = [(n, r["probe"]["load_s"]) for n, r in corp.items() if r.get("probe") and not r["probe"].get("error")]
    if starts:
        n, worst = max(starts, key=lambda x: x[1])
        out.append(
            f"second start, `load_corpus` on the prepared cache: at most {worst:.3f} s ({n}); bar <= 3 s: "
            f"{'PASS' if worst <= 3 else 'FAIL'}"
        )
    trains = [
        (n, lbl, t["corpus_s"])
        for n, r in corp.items()
        for lbl, t in (r.get("train") or {}).items()
        if lbl != "first" and t.get("corpus_s") is not None
    ] + [
        (n, "driver restart", t["restart_corpus_s"])
        for n, r in corp.items()
        for t in (r.get("train") or {}).values()
        if t.get("restart_corpus_s") is not None
    ]
    if trains:
        n, lbl, worst = max(trains, key=lambda x: x[2])
        out.append(
            f"`flexorch train` second run / resume / driver restart, corpus time printed: at most {worst:.1f} s "
            f"({n}, {lbl}); bar <= 3 s: {'PASS' if worst <= 3 else 'FAIL'}"
        )
    shorts = sorted(
        (
            (r["probe"]["documents"], n, r["probe"])
            for n, r in corp.items()
            if r["spec"]["short"] and r.get("probe") and not r["probe"].get("error")
        ),
    )
    if len(shorts) >= 2:
        (d0, n0, p0), (d1, n1, p1) = shorts[0], shorts[-1]
        g = (p1["driver_bytes"] - p0["driver_bytes"]) / (d1 - d0)
        ga = (p1["driver_anon"] - p0["driver_anon"]) / (d1 - d0)
        gf = (p1["driver_file"] - p0["driver_file"]) / (d1 - d0)
        bar = ("PASS" if g <= 16 else "FAIL") if (d0, d1) == (30_000, 3_000_000) else "bar is for 30K vs 3M"
        out.append(
            f"driver memory growth {n0} -> {n1} ({d0:,} -> {d1:,} documents): {g:.1f} bytes a document "
            f"(anonymous {ga:.1f}, file-backed index pages {gf:.1f}); bar <= 16: {bar}"
        )
    return out


def _code_version() -> str:
    """The commit flexorch's code is at, and whether flexorch/ has uncommitted changes."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
        dirty = subprocess.run(["git", "status", "--porcelain", "flexorch"], capture_output=True, text=True, cwd=ROOT)
    except OSError:
        return "unknown"
    return head.stdout.strip() + (" + uncommitted changes under flexorch/" if dirty.stdout.strip() else "")


# ---------------------------------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=None, help="corpora, e.g. 30M,300M,1.2B,short3M (the default)")
    ap.add_argument("--quick", action="store_true", help="3M tokens + short30K + short300K only (a smoke run)")
    ap.add_argument(
        "--results",
        "--out",
        dest="out",
        type=results_arg,
        default=results_file("measured/data_scale"),
        help="write the markdown table here (default benchmarks/results/measured/data_scale.md; '-': no file)",
    )
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/flexorch-data-scale"), help="corpora, stores, runs")
    ap.add_argument("--bpe-on", default=None, help="corpus of the BPE prepare pair (default 300M; --quick: 3M)")
    ap.add_argument("--bpe-vocab", type=int, default=8192, help="BPE vocabulary (default 8192)")
    ap.add_argument("--train-on", default=None, help="corpora for real `flexorch train` runs (default 30M,1.2B)")
    ap.add_argument("--repeats", type=int, default=2, help="rounds of each prepare pair, order alternating (2)")
    ap.add_argument("--no-prepare", action="store_true", help="skip the prepare pairs (stores already in the cache)")
    ap.add_argument("--probe", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe:
        print("PROBE " + json.dumps(probe(json.loads(args.probe))), flush=True)
        return

    from flexorch.config import ModelConfig
    from flexorch.config.data import CorpusConfig

    command = shlex.join([".venv/bin/python", "-m", "benchmarks.measured.data_scale", *sys.argv[1:]])
    if args.quick:
        sizes = args.sizes or "3M,short30K,short300K"
        bpe_on, train_on = args.bpe_on or "3M", args.train_on or "3M"
    else:
        sizes = args.sizes or "30M,300M,1.2B,short3M"
        bpe_on, train_on = args.bpe_on or "300M", args.train_on or "30M,1.2B"
    specs = [parse_size(s) for s in sizes.split(",") if s]
    if any(s["short"] and s["docs"] == 3_000_000 for s in specs) and not any(
        s["short"] and s["docs"] == 30_000 for s in specs
    ):
        specs.append(parse_size("short30K"))  # the other end of the memory comparison
    workdir = args.workdir.expanduser().resolve()
    cache, scratch = workdir / "cache", workdir / "scratch"
    workdir.mkdir(parents=True, exist_ok=True)
    results: dict = {"command": command, "corpora": {}, "code": _code_version()}
    results_path = workdir / "results.json"

    def save() -> None:
        results_path.write_text(json.dumps(results, indent=1, default=str))

    # 1. generate and prepare, in this process, with one Ray for every prepare
    for spec in specs:
        gen = generate(spec, workdir)
        results["corpora"][spec["name"]] = {"spec": spec, "gen": gen}
        results.setdefault("lengths_source", gen["lengths"]) if not spec["short"] else None
    if not args.no_prepare:
        import ray

        ray.init(
            address="local",
            num_cpus=os.cpu_count(),
            include_dashboard=False,
            logging_level="WARNING",
            log_to_driver=False,
            _system_config={"worker_niceness": 0},  # as `flexorch train` starts it (flexorch.cli.train)
        )

        def say(ev: dict) -> None:
            print(f"    {ev['message']}", flush=True)

        warm = generate(parse_size("short2K"), workdir)
        warm_up(CorpusConfig(source=warm["path"], tokenizer="byte"), scratch / "warm-up")

        for spec in specs:
            r = results["corpora"][spec["name"]]
            cfg = CorpusConfig(source=r["gen"]["path"], tokenizer="byte", max_context=MAX_CONTEXT, cache=str(cache))
            r["prepare"] = prepare_pair(cfg, store_dir(cfg, cache), scratch / spec["name"], say, args.repeats)
            save()
            if spec["name"] == bpe_on:
                tok, info = bpe_tokenizer(cfg, workdir, args.bpe_vocab)
                r["bpe_label"] = f"BPE {info['trained_vocab']:,} ids"
                r["bpe"] = info
                bcfg = CorpusConfig(source=r["gen"]["path"], tokenizer=tok, max_context=MAX_CONTEXT)
                warm_up(CorpusConfig(source=warm["path"], tokenizer=tok), scratch / "warm-up-bpe")
                r["prepare_bpe"] = prepare_pair(bcfg, None, scratch / f"{spec['name']}-bpe", say, args.repeats)
                save()
        ray.shutdown()
        shutil.rmtree(scratch, ignore_errors=True)

    # 2-4. fresh processes on the prepared stores; real `flexorch train` runs
    for spec in specs:
        r = results["corpora"][spec["name"]]
        print(f"{spec['name']}: load_corpus, driver memory and worker reads in a fresh process", flush=True)
        r["probe"] = pr = run_probe(r["gen"]["path"], cache)
        if pr.get("error"):
            print(f"  probe failed: {pr['error']}", flush=True)
        else:
            print(
                f"  load_corpus {pr['load_s']:.3f} s, driver +{pr['driver_bytes'] / 2**20:.1f} MiB "
                f"({pr['driver_bytes'] / pr['documents']:.1f} B/doc), "
                f"reads 16: {pr['reads']['16']['median_ms']:.2f} ms,"
                f" 512: {pr['reads']['512']['median_ms']:.1f} ms",
                flush=True,
            )
        save()
    train_names = [n for n in train_on.split(",") if n in results["corpora"]]
    if train_names:
        from benchmarks.measured.fixed_profile import write_fixed_profile

        profile = write_fixed_profile(workdir / "fixed_profile.json", ModelConfig(), "data-scale-fixed")
        for name in train_names:
            results["corpora"][name]["train"] = train_runs(
                name, results["corpora"][name]["gen"]["path"], workdir, cache, profile
            )
            save()

    results["code_after"] = _code_version()
    save()
    text = report(results, args, command)
    print("\n" + text)
    write_report(args.out, text, results_path)


if __name__ == "__main__":
    main()
