"""Prepare a corpus store once, in parallel: source -> work units -> token blocks -> index + manifest.

:func:`prepare_store` lists the source, cuts it into work units (``flexorch.data.store.units``: JSONL by
line-aligned byte ranges), and runs one Ray task per unfinished unit over the whole cluster (SPREAD-scheduled, one
CPU each, one task per CPU in flight). Plain tasks, not a Ray Data ``map``: Ray Data's streaming executor kept the
tasks overlapped only part of the time (docs/guide/data.md has the measurement). A unit task reads its bytes,
tokenizes and splits its documents with the same code the whole corpus always used
(``flexorch.data.readers.pack_records``), and writes its block files atomically (``flexorch.data.store.layout``).
The preparing process then merges the units' small indices with the checks and numbering of a whole-corpus read
(``flexorch.data.readers.assemble_index``: documents by sorted key, the skip counts, a malformed record named by
file and line), writes the per-document index arrays and, last, the manifest (``flexorch.data.store.merge``).

Progress: one line per finished unit at most every ``PROGRESS_EVERY_S`` s, with blocks done, source bytes read,
tokens/s and an ETA. A prepare killed midway and run again redoes only units without a ``done.json``; a prepare
whose source changed since its plan starts over (and says so). Two processes preparing one store take turns
(an advisory file lock).

``parallelism=0`` runs the units in this process, without Ray (tools and unit tests).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

from flexorch.data.errors import DataError
from flexorch.data.store import layout
from flexorch.data.store.fingerprint import describe_change, fingerprints, same_fingerprints, source_files
from flexorch.data.store.merge import finalize, save_unit_meta
from flexorch.data.store.units import plan_units, read_unit, unit_target_bytes

__all__ = ["prepare_store", "prepare_unit", "PROGRESS_EVERY_S"]

PROGRESS_EVERY_S = 5.0


def prepare_store(
    cfg,
    out: str | Path,
    publish=None,
    *,
    listing=None,
    kind: str | None = None,
    parallelism: int | None = None,
    unit_bytes: int | None = None,
    verify: bool = False,
) -> dict:
    """Prepare ``cfg``'s corpus into the store directory ``out`` (created; a finished store with the same
    fingerprints is left as it is). Returns the manifest.

    ``parallelism``: None, every CPU of the Ray cluster (``ray.init()`` is called if Ray is not running); N >= 1,
    at most N unit tasks at once; 0, in this process without Ray. ``unit_bytes``: source bytes per unit (default:
    four units per CPU, 4-128 MiB). ``verify``: of a finished store, also check every block's sha256 (reads them all)
    and prepare again the ones that differ."""
    from flexorch.data.listing import list_source
    from flexorch.data.record_kinds import resolve_kind

    out = Path(os.path.abspath(Path(out).expanduser()))
    say = publish or (lambda ev: None)
    listing = listing or list_source(cfg)
    kind = kind or resolve_kind(listing, cfg)
    fp = fingerprints(cfg, listing, kind)
    out.mkdir(parents=True, exist_ok=True)
    with _locked(out, say):
        manifest = _finished_manifest(out, fp, verify, say)
        if manifest is not None:
            return manifest
        if listing.fmt == "parquet":  # a missing column is named before any task starts
            from flexorch.data.readers import field_of
            from flexorch.data.source_records import check_parquet_field

            check_parquet_field(listing.files, field_of(kind, cfg))
        cpus = _cpus(parallelism)
        plan = _load_or_make_plan(
            out, listing, kind, fp, unit_bytes or unit_target_bytes(fp["source_bytes"], cpus), say
        )
        todo = [i for i in range(len(plan["units"])) if not _unit_done(out, i)]
        spec = _unit_spec(cfg, listing, kind)
        t0 = time.perf_counter()
        if todo:
            _run_units(out, plan, todo, spec, say, parallelism)
        unseen = [i for i in todo if not _unit_done(out, i)]
        if unseen:  # the tasks finished, but not here: they wrote to another node's disk
            raise DataError(
                f"{len(unseen)} of the {len(todo)} blocks prepared into {out} are not visible from this node (first: "
                f"{layout.block_paths(out, unseen[0])['bin'].name}); on a cluster, put the store ([data] cache or "
                "`flexorch prepare` OUT) on a filesystem every node mounts, or prepare to s3:// and train from there"
            )
        return finalize(out, cfg, listing, kind, plan, spec, fp, say, time.perf_counter() - t0)


def _finished_manifest(out: Path, fp: dict, verify: bool, say) -> dict | None:
    """The manifest of a store finished from the same source and settings with no damaged block, else None (the
    damaged blocks are marked to be prepared again)."""
    if not (out / "manifest.json").is_file():
        return None
    manifest = layout.read_manifest(out)
    bad = _bad_units(out, manifest, verify) if same_fingerprints(manifest["fingerprints"], fp) else []
    for i, why in bad:  # redone below; the other blocks are kept
        say({"event": "progress", "message": f"block {i} of {out} is damaged ({why}): preparing it again"})
        layout.block_paths(out, i)["done"].unlink(missing_ok=True)
    if same_fingerprints(manifest["fingerprints"], fp) and not bad:
        say(
            {
                "event": "progress",
                "message": f"{out} is already prepared from this source and these settings: nothing to do",
            }
        )
        return manifest
    return None


def _bad_units(out: Path, manifest: dict, verify: bool) -> list[tuple[int, str]]:
    """Units of a finished store whose block is missing, of the wrong size, or (``verify``) of another sha256."""
    bad = []
    for i, p in enumerate(manifest["parts"]):  # "parts": the store format's name for its blocks
        path = out / "parts" / p["file"]
        if not path.is_file() or path.stat().st_size != p["bytes"]:
            bad.append((i, "missing" if not path.is_file() else f"{path.stat().st_size:,} bytes, not {p['bytes']:,}"))
        elif verify and _sha256(path) != p["sha256"]:
            bad.append((i, "its sha256 differs from the manifest's"))
    return bad


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def damaged_blocks(out: Path, manifest: dict) -> list[str]:
    """Blocks of a finished store whose files are missing or of the wrong size (a truncated copy, a lost file)."""
    bad = []
    for p in manifest["parts"]:
        path = out / "parts" / p["file"]
        if not path.is_file():
            bad.append(f"{p['file']} is missing")
        elif path.stat().st_size != p["bytes"]:
            bad.append(f"{p['file']} has {path.stat().st_size:,} bytes, the manifest says {p['bytes']:,}")
    return bad


@contextlib.contextmanager
def _locked(out: Path, say):
    with open(out / ".lock", "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say({"event": "progress", "message": f"waiting for another process preparing {out}"})
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _cpus(parallelism: int | None) -> int:
    if parallelism is not None:
        return max(1, parallelism)
    import ray

    if not ray.is_initialized():
        return os.cpu_count() or 1
    return max(1, int(ray.cluster_resources().get("CPU", 1)))


def _load_or_make_plan(out: Path, listing, kind: str, fp: dict, unit_bytes: int, say) -> dict:
    """The store's work plan: the one on disk when it was made for the same source and settings (an interrupted
    prepare continues it), else a new one (old blocks are removed)."""
    path = out / "plan.json"
    files = source_files(listing)
    if path.is_file():
        try:
            plan = json.loads(path.read_text())
        except ValueError:
            plan = None
        if plan is not None and same_fingerprints(plan["fingerprints"], fp):
            done = sum(_unit_done(out, i) for i in range(len(plan["units"])))
            if done:
                say(
                    {
                        "event": "progress",
                        "message": f"continuing an unfinished prepare of {out}: "
                        f"{done} of {len(plan['units'])} blocks already done",
                    }
                )
            return plan
        if plan is not None:
            change = describe_change(plan["fingerprints"], fp, plan.get("source_files"), files)
            say(
                {
                    "event": "progress",
                    "message": f"{out} was prepared from other data or settings ({change}); preparing it again",
                }
            )
    for sub in ("parts", "index"):  # "parts/": the store format's directory of blocks
        shutil.rmtree(out / sub, ignore_errors=True)
    (out / "manifest.json").unlink(missing_ok=True)
    (out / "parts").mkdir(parents=True)
    units = plan_units(listing.files, listing.fmt, unit_bytes)
    plan = {"format": layout.FORMAT, "fingerprints": fp, "source_files": files, "units": units}
    plan |= {"unit_bytes": unit_bytes, "fmt": listing.fmt, "base": listing.base, "kind": kind}
    layout.atomic_write_json(path, plan)
    return plan


def _unit_done(out: Path, i: int) -> bool:
    paths = layout.block_paths(out, i)
    if not paths["done"].is_file():
        return False
    try:
        done = json.loads(paths["done"].read_text())
    except ValueError:
        return False
    return all(paths[k].is_file() for k in ("bin", "sums", "meta")) and paths["bin"].stat().st_size == done["bytes"]


def _unit_spec(cfg, listing, kind: str) -> dict:
    from flexorch.data.readers import kind_fields
    from flexorch.data.tokenizer import get_tokenizer

    vocab = None if kind == "tokenized" else get_tokenizer(cfg.tokenizer).vocab_size
    dtype = layout.token_dtype(vocab, masked=kind != "text")
    columns = list(kind_fields(kind, cfg)) if listing.fmt == "parquet" else None
    return {
        "cfg": cfg,
        "base": listing.base,
        "fmt": listing.fmt,
        "kind": kind,
        "dtype": dtype.str,
        "columns": columns,
        "vocab_size": vocab,
    }


class _Progress:
    """The prepare's progress line: blocks done, source bytes read, tokens/s and an ETA, at most every
    ``PROGRESS_EVERY_S`` s (and for the last block)."""

    def __init__(self, units: list[dict], todo: list[int], say):
        self.units, self.n_todo, self.say = units, len(todo), say
        self.total_bytes = sum(units[i]["bytes"] for i in todo) or 1
        self.t0, self.told = time.monotonic(), -1e9
        self.state = {"blocks": 0, "bytes": 0, "tokens": 0}

    def report(self, res: dict) -> None:
        """Count one finished unit; say the line when it is due."""
        state, total_bytes = self.state, self.total_bytes
        state["blocks"] += 1
        state["bytes"] += self.units[res["unit"]]["bytes"]
        state["tokens"] += res["tokens"]
        now = time.monotonic()
        if now - self.told < PROGRESS_EVERY_S and state["blocks"] < self.n_todo:
            return
        self.told, dt = now, max(now - self.t0, 1e-6)
        eta = (total_bytes - state["bytes"]) / max(state["bytes"] / dt, 1e-9)
        self.say(
            {
                "event": "progress",
                "message": (
                    f"preparing the corpus: {state['blocks']}/{self.n_todo} blocks, {state['bytes'] / 2**20:,.1f} of "
                    f"{total_bytes / 2**20:,.1f} MiB read, {state['tokens']:,} tokens "
                    f"({state['tokens'] / dt / 1e6:.2f}M tokens/s), ETA {eta:.0f} s"
                ),
            }
        )


def _run_units(out: Path, plan: dict, todo: list[int], spec: dict, say, parallelism: int | None) -> None:
    units = plan["units"]
    progress = _Progress(units, todo, say)
    say(
        {
            "event": "progress",
            "message": f"preparing the corpus into {out}: {len(todo)} blocks of "
            f"{progress.total_bytes / 2**20:,.1f} MiB of {plan['fmt']} source",
        }
    )
    if parallelism == 0:
        for i in todo:
            progress.report(prepare_unit(str(out), i, units[i], spec))
        return
    _run_units_on_ray(out, units, todo, spec, progress.report, parallelism)


def _run_units_on_ray(out: Path, units: list[dict], todo: list[int], spec: dict, report, parallelism) -> None:
    """One SPREAD Ray task per unit, at most one per CPU (or ``parallelism``) in flight; the first failure raised."""
    import ray

    if not ray.is_initialized():
        ray.init(logging_level="WARNING", log_to_driver=False)
    cap = parallelism or max(1, int(ray.cluster_resources().get("CPU", 1)))
    task = ray.remote(num_cpus=1, max_retries=2)(_unit_task).options(scheduling_strategy="SPREAD")
    failed, queue, running = [], list(todo), {}
    try:
        while queue or running:
            while queue and len(running) < cap:  # at most one task per CPU in flight: progress stays truthful
                i = queue.pop(0)
                running[task.remote(str(out), i, units[i], spec)] = i
            done, _ = ray.wait(list(running), num_returns=1)
            for ref in done:
                running.pop(ref)
                res = ray.get(ref)
                if res.get("error"):
                    failed.append(res)
                else:
                    report(res)
    except ray.exceptions.RayError as e:  # a node lost mid-prepare: its finished blocks stay, run again to finish
        raise DataError(
            f"preparing {out} failed: {type(e).__name__}: {str(e).splitlines()[0]}; run it again: "
            "finished blocks are kept"
        ) from e
    if failed:  # the finished blocks stay: a run after the fix redoes only the failed ones
        first = min(failed, key=lambda r: r["unit"])
        if first["data_error"]:
            raise DataError(first["error"])
        raise DataError(f"preparing block {first['unit']} of {out} failed: {first['error']}")


def _unit_task(store: str, i: int, unit: dict, spec: dict) -> dict:
    """`prepare_unit` as a Ray task: an error travels back as a value, named, not as a task failure."""
    try:
        return prepare_unit(store, i, unit, spec)
    except Exception as e:  # noqa: BLE001
        return {"unit": i, "tokens": 0, "error": str(e), "data_error": isinstance(e, DataError)}


def prepare_unit(store: str, i: int, unit: dict, spec: dict) -> dict:
    """Read, tokenize and write one work unit's block (its .bin, .sums.npy, .meta.npz and, last, .done.json)."""
    from flexorch.data.readers import pack_records

    t0 = time.perf_counter()
    paths = layout.block_paths(store, i)
    cfg, fmt, dtype = spec["cfg"], spec["fmt"], np.dtype(spec["dtype"])
    try:
        table = read_unit(unit, fmt, spec["columns"])
    except Exception as e:  # noqa: BLE001 - an unreadable file: named, with what to do
        msg = str(e).strip().splitlines()[-1] if str(e).strip() else ""
        raise DataError(
            f"could not read {unit['files'][0] if len(unit['files']) == 1 else unit['files']} as {fmt}: "
            f"{type(e).__name__}: {msg} (fix or remove the file, or set format= to how the data is stored)"
        ) from e
    gen = pack_records(table, (spec["base"], fmt, cfg, spec["kind"]), cfg.block_tokens)
    sha, sums, written, starts, meta = _write_block(paths["bin"], gen, dtype, unit)
    layout.atomic_save_npy(paths["sums"], np.asarray(sums, dtype=np.uint64))
    save_unit_meta(paths, meta, starts, _newlines(table) if fmt == "jsonl" else None)
    tokens = int(written)
    done = {"unit": i, "bytes": tokens * dtype.itemsize, "tokens": tokens, "sha256": sha.hexdigest()}
    done |= {"documents": int(len(meta["doc_length"])), "seconds": round(time.perf_counter() - t0, 3)}
    layout.atomic_write_json(paths["done"], done)
    return {"unit": i, "tokens": tokens, "seconds": done["seconds"]}


def _write_block(path: Path, gen, dtype: np.dtype, unit: dict):
    """Write `pack_records`' token buffers to the block file ``path`` (atomically); returns its sha256, its
    ``layout.HASH_CHUNK`` chunk digests, the tokens written, each buffer's start and the metadata dict."""
    sha, sums, pending, written, starts, meta = hashlib.sha256(), [], bytearray(), 0, [], None
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        for item in gen:
            if isinstance(item, dict):
                meta = item
                break
            arr = np.asarray(item)
            if dtype.kind == "u" and arr.size and int(arr.min()) < 0:
                raise DataError(f"{unit['files'][0]}: a negative token id in a store of {dtype}")
            data = arr.astype(dtype).tobytes()
            starts.append(written)
            written += arr.size
            f.write(data)
            sha.update(data)
            pending += data
            while len(pending) >= layout.HASH_CHUNK:
                sums.append(_chunk_digest(pending[: layout.HASH_CHUNK]))
                del pending[: layout.HASH_CHUNK]
        if pending:
            sums.append(_chunk_digest(pending))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return sha, sums, written, starts, meta


def _chunk_digest(data) -> int:
    return int.from_bytes(hashlib.blake2b(bytes(data), digest_size=8).digest(), "little")


def _newlines(table) -> int:
    return int(sum(d.count(b"\n") for d in table.column("bytes").to_pylist()))
