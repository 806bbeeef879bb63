"""Byte-range reads and small-file fetches of a prepared token store, local or in an object store.

A store lives in a local directory (a shared filesystem is local too; ``file:///path`` is a local path) or under an
object-store URI, ``s3://bucket/prefix`` or ``gs://bucket/prefix``. Training workers read a few KB-MB at random
offsets of the large immutable block files through :func:`open_range_source`; remote reads go through a bounded
on-disk cache of fixed-size chunks (``~/.cache/flexorch/remote`` unless ``cache_dir`` says otherwise) that the
processes of a host share. The driver gets the small files (manifest, indices) as local paths from
:func:`fetch_small`. Objects are read with pyarrow's filesystems, configured the standard way:

* S3 credentials: ``AWS_ACCESS_KEY_ID`` + ``AWS_SECRET_ACCESS_KEY`` (+ ``AWS_SESSION_TOKEN``), ``AWS_PROFILE`` /
  ``~/.aws/credentials``, or the instance role; region: ``AWS_DEFAULT_REGION`` / ``AWS_REGION``.
* S3-compatible endpoint (MinIO, Ceph, R2, a test server): ``FLEXORCH_S3_ENDPOINT``, else ``AWS_ENDPOINT_URL_S3``,
  else ``AWS_ENDPOINT_URL``, as a URL such as ``http://10.0.0.5:9000``. flexorch passes it to pyarrow itself, since
  not every pyarrow release reads the AWS variables; ``?endpoint_override=host:9000&scheme=http`` on a URI wins.
* GCS credentials: ``GOOGLE_APPLICATION_CREDENTIALS`` or the machine's default credentials.

Cached chunks and small files are keyed by URI, object size and ETag (else modification time), so a re-uploaded object
is never served stale, and written to a temporary file then renamed, so a killed process leaves no partial file.
Errors a user can fix (a missing object or bucket, no credentials, an unreachable endpoint) raise a
:class:`~flexorch.data.lengths.DataError` that names the URI and what to set.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
import urllib.parse
from pathlib import Path

import pyarrow.fs as pafs

from flexorch.data.errors import DataError

__all__ = [
    "RangeSource", "open_range_source", "fetch_small", "is_remote", "join", "exists", "list_dir", "upload_dir",
    "filesystem", "store_error", "DEFAULT_CHUNK_BYTES",
]  # fmt: skip

DEFAULT_CHUNK_BYTES = 8 << 20
_REMOTE_SCHEMES = ("s3", "gs", "gcs")
_ENDPOINT_VARS = ("FLEXORCH_S3_ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
_STALE_TMP_S = 3600.0


def is_remote(uri: str) -> bool:
    """Whether ``uri`` names an object store (``s3://``, ``gs://``); plain paths and ``file://`` URIs are local."""
    return urllib.parse.urlsplit(str(uri)).scheme.lower() in _REMOTE_SCHEMES


def _local_path(uri: str) -> str:
    parts = urllib.parse.urlsplit(str(uri))
    if parts.scheme.lower() == "file":
        return urllib.parse.unquote(parts.path)
    if "://" in str(uri):
        raise DataError(f"{uri}: unsupported URI scheme {parts.scheme!r} (use a local path, s3:// or gs://)")
    return os.path.expanduser(str(uri))


def join(uri: str, *parts: str) -> str:
    """``uri`` with ``parts`` appended as path components, keeping a query string (``?endpoint_override=...``)."""
    base, sep, query = str(uri).partition("?")
    return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)]) + sep + query


def _endpoint_uri(uri: str) -> str:
    """``uri`` with the S3 endpoint of the environment as ``endpoint_override`` unless the URI already names one."""
    parts = urllib.parse.urlsplit(uri)
    endpoint = next((os.environ[v] for v in _ENDPOINT_VARS if os.environ.get(v)), None)
    if parts.scheme.lower() != "s3" or endpoint is None or "endpoint_override=" in parts.query:
        return uri
    query = "&".join(q for q in (parts.query, "endpoint_override=" + urllib.parse.quote(endpoint, safe="")) if q)
    return urllib.parse.urlunsplit(parts._replace(query=query))


def store_error(uri: str, exc: BaseException) -> DataError:
    """A message a user can act on for a failed object-store call (credentials, endpoint, bucket), naming ``uri``."""
    low = str(exc).lower()
    endpoint = next((f"{v}={os.environ[v]}" for v in _ENDPOINT_VARS if os.environ.get(v)), "the default AWS endpoint")
    if any(s in low for s in ("network_connection", "could not connect", "curlcode", "resolve host", "timed out")):
        what = f"cannot reach the object store ({endpoint}); set FLEXORCH_S3_ENDPOINT (or AWS_ENDPOINT_URL) to a reachable endpoint such as http://host:9000"  # noqa: E501
    elif any(s in low for s in ("access_denied", "accessdenied", "invalidaccesskeyid", "signaturedoesnotmatch",
                                "credential", "forbidden", "unauthorized", "permission")):  # fmt: skip
        what = "access denied or no credentials; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) for s3://, GOOGLE_APPLICATION_CREDENTIALS for gs://"  # noqa: E501
    elif re.search(r"bucket '[^']*' (not found|does not exist)|nosuchbucket|no_such_bucket", low):
        what = "the bucket does not exist (create it, or check the URI and the endpoint)"
    elif isinstance(exc, FileNotFoundError) or any(s in low for s in ("nosuchkey", "does not exist", "not found")):
        what = "no such object"
    else:
        what = str(exc)
    return DataError(f"{uri}: {what} [{type(exc).__name__}: {str(exc)[:300]}]")


def _resolve(uri: str) -> tuple[pafs.FileSystem, str, str]:
    """(filesystem, path inside it, the URI as resolved with the endpoint) for a remote ``uri``."""
    full = _endpoint_uri(uri)
    try:
        fs, path = pafs.FileSystem.from_uri(full)
    except Exception as exc:  # pyarrow raises ArrowInvalid/OSError for bad URIs and missing S3/GCS support
        raise store_error(uri, exc) from exc
    return fs, path, full


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _missing(fs: pafs.FileSystem, path: str) -> bool:
    try:
        return fs.get_file_info(path).type == pafs.FileType.NotFound
    except OSError:
        return False


def _open_remote(uri: str) -> tuple[pafs.FileSystem, object, int, str, str]:
    """(filesystem, open input file, size, version, resolved URI); the version is the ETag else the mtime."""
    fs, path, full = _resolve(uri)
    try:
        handle = fs.open_input_file(path)
        size = handle.size()
        meta = {_text(k).lower(): _text(v) for k, v in (handle.metadata() or {}).items()}
        version = meta.get("etag") or meta.get("last-modified") or str(fs.get_file_info(path).mtime_ns)
    except OSError as exc:
        bucket = path.split("/", 1)[0]
        if isinstance(exc, FileNotFoundError) and _missing(fs, bucket):
            raise DataError(f"{uri}: the bucket {bucket!r} does not exist (check the URI and the endpoint)") from exc
        raise store_error(uri, exc) from exc
    return fs, handle, size, version, full


def _cache_root(cache_dir: str | None) -> Path:
    """``cache_dir``, else ``$FLEXORCH_REMOTE_CACHE``, else ``~/.cache/flexorch/remote``."""
    if cache_dir or os.environ.get("FLEXORCH_REMOTE_CACHE"):
        return Path(cache_dir or os.environ["FLEXORCH_REMOTE_CACHE"]).expanduser()
    return Path.home() / ".cache" / "flexorch" / "remote"


def _key(full_uri: str, size: int, version: str) -> str:
    return hashlib.sha256(f"{full_uri}\0{size}\0{version}".encode()).hexdigest()[:32]


def _atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a per-process temporary file and a rename (readers never see a partial file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}.{os.urandom(4).hex()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class RangeSource:
    """Random byte-range reads of one file, local or remote; open one with :func:`open_range_source`."""

    uri: str
    size: int

    def read(self, offset: int, nbytes: int) -> bytes:
        """Exactly ``nbytes`` bytes at ``offset``; a range outside ``[0, size]`` is a ValueError naming the URI."""
        offset, nbytes = int(offset), int(nbytes)
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(f"{self.uri}: read of {nbytes} bytes at offset {offset} is outside its {self.size} bytes")
        return self._read(offset, nbytes) if nbytes else b""

    def _read(self, offset: int, nbytes: int) -> bytes:
        raise NotImplementedError

    def close(self) -> None:
        """Release the file handle (a closed source cannot be read)."""

    def __enter__(self) -> RangeSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> tuple:  # a pickled source (e.g. sent to a Ray worker) reopens the file there
        return (open_range_source, self._args)


class _LocalSource(RangeSource):
    def __init__(self, uri: str, args: tuple) -> None:
        self.uri, self._args, self._fd = uri, args, None
        try:
            self._fd = os.open(_local_path(uri), os.O_RDONLY)
        except FileNotFoundError as exc:
            raise DataError(f"{uri}: no such file") from exc
        self.size = os.fstat(self._fd).st_size

    def _read(self, offset: int, nbytes: int) -> bytes:
        if self._fd is None:
            raise ValueError(f"{self.uri}: read from a closed source")
        out = os.pread(self._fd, nbytes, offset)
        if len(out) != nbytes:
            raise DataError(f"{self.uri}: short read ({len(out)} of {nbytes} bytes at {offset}); was it truncated?")
        return out

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            self.close()


class _RemoteSource(RangeSource):
    """Reads through ``cache_dir/chunks``: chunk ``i`` of an object is ``<key>.<i>``, LRU by modification time."""

    def __init__(self, uri: str, cache_dir: str | None, cache_bytes: int, chunk_bytes: int, args: tuple) -> None:
        self.uri, self._args, self.cache_bytes, self.chunk_bytes = uri, args, int(cache_bytes), int(chunk_bytes)
        if self.chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self._fs, self._handle, self.size, version, full = _open_remote(uri)
        self._dir = _cache_root(cache_dir) / "chunks"
        self._dir.mkdir(parents=True, exist_ok=True)
        self._key = _key(full, self.size, version)

    def _read(self, offset: int, nbytes: int) -> bytes:
        out, end, cb = [], offset + nbytes, self.chunk_bytes
        for idx in range(offset // cb, (end - 1) // cb + 1):
            lo, hi = max(offset, idx * cb) - idx * cb, min(end, (idx + 1) * cb) - idx * cb
            out.append(self._chunk(idx, lo, hi))
        return b"".join(out)

    def _chunk(self, idx: int, lo: int, hi: int) -> bytes:
        """Bytes ``[lo, hi)`` of chunk ``idx``, from the cache when it holds the chunk, else fetched and cached."""
        path = self._dir / f"{self._key}.{idx}"
        want = min(self.chunk_bytes, self.size - idx * self.chunk_bytes)
        try:
            fd = os.open(path, os.O_RDONLY)  # may be evicted by another process any time: an open fd stays valid
        except FileNotFoundError:
            fd = None
        if fd is not None:
            try:
                if os.fstat(fd).st_size == want:
                    os.utime(fd)  # LRU: recently read chunks are evicted last
                    return os.pread(fd, hi - lo, lo)
            finally:
                os.close(fd)
        try:
            data = self._handle.read_at(want, idx * self.chunk_bytes)
        except OSError as exc:
            raise store_error(self.uri, exc) from exc
        if len(data) != want:
            raise DataError(f"{self.uri}: got {len(data)} of {want} bytes at {idx * self.chunk_bytes}; was it changed?")
        _atomic_write(path, data)
        self._evict()
        return data[lo:hi]

    def _evict(self) -> None:
        """Delete the least recently used chunks (of any object) until the cache holds at most ``cache_bytes``."""
        entries, total, now = [], 0, time.time()
        with os.scandir(self._dir) as it:
            for e in it:
                try:
                    st = e.stat()
                except FileNotFoundError:
                    continue
                if ".tmp." in e.name:  # another process's write in flight, or the leftover of a killed one
                    if now - st.st_mtime > _STALE_TMP_S:
                        Path(e.path).unlink(missing_ok=True)
                    continue
                entries.append((st.st_mtime, e.path, st.st_size))
                total += st.st_size
        for _, path, size in sorted(entries):
            if total <= self.cache_bytes:
                break
            Path(path).unlink(missing_ok=True)
            total -= size

    def close(self) -> None:
        self._handle.close()


def open_range_source(
    uri: str, cache_dir: str | None = None, cache_bytes: int = 2 << 30, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> RangeSource:
    """A :class:`RangeSource` over ``uri``: ``os.pread`` of a local file, else chunked reads cached in ``cache_dir``.

    The remote cache keeps at most ``cache_bytes`` of chunks (of all objects together; several processes sharing
    the directory may briefly exceed it by a chunk each). A DataError names a missing object or a setting to fix.
    """
    args = (uri, cache_dir, cache_bytes, chunk_bytes)
    if is_remote(uri):
        return _RemoteSource(uri, cache_dir, cache_bytes, chunk_bytes, args)
    return _LocalSource(uri, args)


def fetch_small(uri: str, cache_dir: str | None = None) -> str:
    """A local path holding the whole file ``uri``: the path itself when local, else a copy under ``cache_dir/small``.

    A remote object is downloaded once per version; a later call checks its size and ETag/mtime (one metadata
    request) and returns the same path while they are unchanged.
    """
    if not is_remote(uri):
        path = _local_path(uri)
        if not os.path.isfile(path):
            raise DataError(f"{uri}: no such file")
        return path
    _, handle, size, version, full = _open_remote(uri)
    try:
        dest = _cache_root(cache_dir) / "small" / _key(full, size, version) / (full.split("?")[0].rsplit("/", 1)[-1])
        if not (dest.is_file() and dest.stat().st_size == size):
            try:
                data = handle.read_at(size, 0) if size else b""
            except OSError as exc:
                raise store_error(uri, exc) from exc
            _atomic_write(dest, data)
        return str(dest)
    finally:
        handle.close()


def filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """(pyarrow filesystem, path inside it) of a local path or an object-store URI (the endpoint and credentials of
    the environment, as for reads)."""
    if is_remote(uri):
        return _resolve(uri)[:2]
    return pafs.LocalFileSystem(), os.path.abspath(_local_path(uri))


def exists(uri: str) -> bool:
    """Whether a file (or directory) exists at ``uri``."""
    fs, path = filesystem(uri)
    try:
        return fs.get_file_info(path).type != pafs.FileType.NotFound
    except OSError as exc:
        raise store_error(uri, exc) from exc


def list_dir(uri: str) -> list[str]:
    """The files under the directory ``uri``, recursively, as sorted ``/``-separated paths relative to it."""
    fs, path = filesystem(uri)
    try:
        infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
    except OSError as exc:
        raise store_error(uri, exc) from exc
    base = path.rstrip("/") + "/"
    return sorted(i.path[len(base) :] for i in infos if i.type == pafs.FileType.File and i.path.startswith(base))


def upload_dir(local_dir: str, uri: str) -> None:
    """Copy the directory tree ``local_dir`` to ``uri`` (an object-store prefix or a local directory)."""
    src = os.path.abspath(_local_path(local_dir))
    if not os.path.isdir(src):
        raise DataError(f"{local_dir}: not a directory")
    dst_fs, dst = filesystem(uri)
    if not is_remote(uri):
        os.makedirs(dst, exist_ok=True)
    try:
        pafs.copy_files(src, dst, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=dst_fs)
    except OSError as exc:
        raise store_error(uri, exc) from exc
