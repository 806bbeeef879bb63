"""Work units of a prepare: which source bytes each block reads, and reading them into the Arrow table that
``flexorch.data.readers.pack_records`` takes. Pure Python + pyarrow, no Ray.

- JSONL: each file is cut into line-aligned byte ranges of about ``unit_bytes`` (a record never straddles two
  units), so one large file is tokenized by as many tasks as it has ranges, not by one;
- text files: consecutive files (in sorted order) grouped to about ``unit_bytes``;
- Parquet and ``datasets`` Arrow files: one unit per file.

Units are in source order (files sorted, ranges in file order), so concatenating the units' records gives the
same record numbering as reading each file whole.
"""

from __future__ import annotations

import os

__all__ = ["plan_units", "read_unit", "unit_target_bytes"]

MAX_UNIT_BYTES = 128 << 20
"""Source bytes per unit at most: about 256 MB of tokens with a byte tokenizer stored as uint16."""
MIN_UNIT_BYTES = 4 << 20


def unit_target_bytes(total_bytes: int, cpus: int) -> int:
    """Source bytes per unit: at least four units per CPU where the source is large enough, at most 128 MiB."""
    return int(max(MIN_UNIT_BYTES, min(MAX_UNIT_BYTES, -(-total_bytes // max(1, 4 * cpus)))))


def plan_units(files: list[str], fmt: str, unit_bytes: int) -> list[dict]:
    """``[{"files": [...], "start": s, "end": e, "bytes": n}]``: ``start``/``end`` cut a JSONL file (None: whole)."""
    units: list[dict] = []
    if fmt == "jsonl":
        for f in files:
            size = os.path.getsize(f)
            cuts = [0]
            while cuts[-1] < size:
                nxt = _line_start(f, min(size, cuts[-1] + unit_bytes), size)
                cuts.append(nxt)
            for s, e in zip(cuts, cuts[1:], strict=False):
                units.append({"files": [f], "start": s, "end": e, "bytes": e - s})
            if size == 0:
                units.append({"files": [f], "start": 0, "end": 0, "bytes": 0})
        return units
    if fmt == "text":
        group, total = [], 0
        for f in files:
            group.append(f)
            total += os.path.getsize(f)
            if total >= unit_bytes:
                units.append({"files": group, "start": None, "end": None, "bytes": total})
                group, total = [], 0
        if group:
            units.append({"files": group, "start": None, "end": None, "bytes": total})
        return units
    return [{"files": [f], "start": None, "end": None, "bytes": os.path.getsize(f)} for f in files]


def _line_start(path: str, pos: int, size: int) -> int:
    """The first line start at or after ``pos`` (``size`` when none): the byte after the first newline at or
    after ``pos - 1``."""
    if pos >= size:
        return size
    with open(path, "rb") as f:
        f.seek(pos - 1)
        at = pos - 1
        while True:
            buf = f.read(1 << 16)
            if not buf:
                return size
            i = buf.find(b"\n")
            if i >= 0:
                return at + i + 1
            at += len(buf)


def read_unit(unit: dict, fmt: str, columns: list[str] | None = None):
    """The unit's records as the Arrow table ``pack_records`` reads: ``bytes`` + ``path`` rows (text, JSONL,
    ``datasets`` Arrow files), or a Parquet file's ``columns`` (those it has) + ``path``."""
    import pyarrow as pa

    if fmt == "parquet":
        import pyarrow.parquet as pq

        (f,) = unit["files"]
        have = set(pq.read_schema(f).names)
        table = pq.read_table(f, columns=[c for c in columns or [] if c in have])
        return table.append_column("path", pa.array([f] * table.num_rows, pa.string()))
    datas = []
    for f in unit["files"]:
        with open(f, "rb") as fh:
            if unit.get("start") is None:
                datas.append(fh.read())
            else:
                fh.seek(unit["start"])
                datas.append(fh.read(unit["end"] - unit["start"]))
    return pa.table({"bytes": pa.array(datas, pa.large_binary()), "path": pa.array(unit["files"], pa.string())})
