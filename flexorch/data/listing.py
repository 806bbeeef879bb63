"""Which files a corpus source holds, and in which format: `list_source`, the first step of building a corpus.

We list directories ourselves because Ray Data's expansion skips names starting with "." or "_", such as
`__init__.py`, and we count what the listing leaves out. Plain file reads only (no Ray): the pre-flight check
(`flexorch.data.source_check`) and the BPE trainer (`flexorch.data.bpe`) list with it too.
"""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from flexorch.data.errors import DataError

if TYPE_CHECKING:
    from flexorch.config.data import CorpusConfig

__all__ = ["JSONL_SUFFIXES", "Listing", "list_source"]

JSONL_SUFFIXES = (".jsonl", ".ndjson")


class Listing(NamedTuple):
    """What `list_source` found: the absolute `source`, the directory `base` the keys are relative to, the `files`
    to read as `fmt` ('text', 'jsonl', 'parquet' or 'hf_dataset': Arrow stream files), and counts of the names it
    left out."""

    source: str
    base: str
    files: list[str]
    fmt: str
    skipped_hidden: int
    skipped_extension: int


def list_source(cfg: CorpusConfig) -> Listing:
    """The files of `cfg.source` to read, their format, and counts of the names left out."""
    exclude, exts = set(), cfg.extensions
    if cfg.source is None:  # the embedded default: the stdlib's own .py files
        root, exclude, exts = sysconfig.get_paths()["stdlib"], {"site-packages", "dist-packages"}, exts or (".py",)
    root = Path(os.path.abspath(Path(cfg.source or root).expanduser()))
    if not root.exists():
        raise DataError(f"{root} does not exist (give a directory of text files, a JSONL file or a Parquet file)")
    if root.is_dir() and cfg.format in ("auto", "hf_dataset") and _is_hf_dataset(root):
        return _hf_dataset(root, cfg)
    if cfg.format == "hf_dataset":
        raise DataError(
            f"{root} is not a Hugging Face datasets directory (no state.json or dataset_dict.json: write it with "
            "Dataset.save_to_disk), or set format to how the data is stored"
        )
    if root.is_file():
        if root.stat().st_size == 0:
            raise DataError(f"{root} is empty (0 bytes): no documents to read; point source at your data")
        fmt = cfg.format if cfg.format != "auto" else _sniff(root)
        return Listing(str(root), str(root.parent), [str(root)], fmt, 0, 0)
    files, hidden = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        hidden += sum(n.startswith(".") for n in dirnames + filenames)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in exclude)
        files += [os.path.join(dirpath, f) for f in filenames if not f.startswith(".")]
    files = sorted(f for f in files if os.path.isfile(f))
    suffix = {f: Path(f).suffix.lower() for f in files}
    fmt = cfg.format
    if fmt == "auto":
        seen = {x for x in suffix.values() if exts is None or x in exts}
        fmt = "jsonl" if seen and seen <= set(JSONL_SUFFIXES) else "parquet" if seen == {".parquet"} else "text"
    if exts is None and fmt != "text":
        exts = (*JSONL_SUFFIXES, ".json") if fmt == "jsonl" else (".parquet",)
    chosen = [f for f in files if exts is None or suffix[f] in exts]
    if not chosen:
        what = f"no files with suffix {', '.join(exts)}" if exts else "no (non-hidden) files"
        raise DataError(f"{root} has {what} ({len(files)} other files); point source at your data or set extensions")
    return Listing(str(root), str(root), chosen, fmt, hidden, len(files) - len(chosen))


def _sniff(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES or suffix == ".parquet":
        return "parquet" if suffix == ".parquet" else "jsonl"
    with path.open("rb") as f:
        head = f.read(1 << 16)
    if head.startswith(b"PAR1"):
        return "parquet"
    if suffix == ".json":
        try:
            return "jsonl" if isinstance(json.loads(head.split(b"\n", 1)[0]), dict) else "text"
        except ValueError:
            return "text"
    return "text"


def _is_hf_dataset(root: Path) -> bool:
    return (root / "state.json").is_file() or (root / "dataset_dict.json").is_file()


def _hf_dataset(root: Path, cfg: CorpusConfig) -> Listing:
    """The Arrow files of a ``datasets`` ``save_to_disk`` directory (a ``DatasetDict``: of split ``cfg.split``),
    in the order its ``state.json`` lists them (the dataset's row order)."""
    if (root / "dataset_dict.json").is_file():
        splits = json.loads((root / "dataset_dict.json").read_text()).get("splits", [])
        if cfg.split not in splits:
            raise DataError(
                f"{root} is a DatasetDict with splits {', '.join(splits) or '(none)'}; set [data] split to one of them "
                f"(it is {cfg.split!r})"
            )
        root = root / cfg.split
    try:
        state = json.loads((root / "state.json").read_text())
        names = [d["filename"] for d in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"{root}/state.json does not list the dataset's Arrow files ({type(e).__name__}: {e})") from e
    files = [str(root / n) for n in names]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing or not files:
        raise DataError(f"{root}: the dataset's Arrow file {missing[0] if missing else '(none listed)'} is missing")
    return Listing(str(root), str(root), files, "hf_dataset", 0, 0)
