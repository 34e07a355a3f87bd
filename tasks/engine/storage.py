"""Storage primitives over fsspec: one code path for a local folder and s3:// (s3fs).

Every write here is atomic: a local file is written to a temporary name in the
same folder and renamed into place; an object store gets one PUT. A crash can
leave a stray temporary file, never a partial file under a final name.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

TMP_MARK = ".tmp-"  # temporary files carry this in their name; readers skip them
PARQUET_MAGIC = b"PAR1"
_IPC_OPTIONS = ipc.IpcWriteOptions()
_IPC_ZSTD = ipc.IpcWriteOptions(compression="zstd")
# Tables from this many cells (rows x columns, ~1 MB of float64) on are written
# zstd-compressed (Arrow compresses each buffer; readers need nothing to know). A day of
# features (400,000 rows x 22 float columns) goes from 70 MB to 22 MB, and is written
# faster (0.09 s against 0.23 s: fewer bytes to copy); below, the per-buffer cost is
# not repaid, and the 10^6-node scale tests' outputs stay as they were. Counted in
# cells, not bytes: the choice must depend on the content alone, the same for a slice
# of a batch's table as for the node's table computed alone (a slice's buffer size is
# its parent's), or a re-run would not reproduce the stored bytes.
COMPRESS_FROM_CELLS = 1 << 17
_IPC_READ_OPTIONS = ipc.IpcReadOptions()


@dataclass(frozen=True, slots=True)
class Blob:
    """A stored table: a whole file, or a byte range of a pack file, and its sha256.

    Small tables (a day of one product, one node's output) cost far more to open as
    separate Parquet files (~0.5-1 ms each here) than to slice out of a pack of
    Arrow IPC streams (~20 us), so packs hold many blobs; each keeps its own digest.
    """

    url: str
    offset: int
    length: int
    digest: str


# What s3fs reads from the environment: part of the cache key, so a process that
# switches endpoints or credentials never reuses a filesystem built for the old ones.
_S3_ENV = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_DEFAULT_REGION",
    "AWS_MAX_ATTEMPTS",
    "AWS_RETRY_MODE",
)


@lru_cache(maxsize=32)
def _fs_for(protocol: str, env: tuple[str | None, ...]) -> fsspec.AbstractFileSystem:
    # skip_instance_cache: fsspec's own cache ignores the environment.
    fs, _ = fsspec.core.url_to_fs(f"{protocol}://", skip_instance_cache=True)
    return fs


def filesystem(url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """(filesystem, path inside it) for a local path or a URL such as s3://bucket/x.

    Filesystems are cached per protocol and S3 environment, so a worker reading
    many partitions opens one connection pool.
    """
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    env = tuple(os.environ.get(k) for k in _S3_ENV) if protocol in ("s3", "s3a") else ()
    fs = _fs_for(protocol, env)
    return fs, fs._strip_protocol(url)


class StorageError(OSError):
    """An object-store call that failed after the client's own retries, naming the URL."""


@contextlib.contextmanager
def _naming(url: str, action: str) -> Iterator[None]:
    """Errors of a remote store, re-raised naming the URL. s3fs and botocore already
    retry throttling (503 SlowDown) and dropped connections with backoff (measured
    through a proxy failing every third request: all calls succeed); what reaches here
    is a store that stayed down (~30-40 s of retries) or refused the call, and its own
    message often names no object ("[Errno 16] Please reduce your request rate.")."""
    try:
        yield
    except FileNotFoundError:
        raise
    except Exception as exc:
        raise StorageError(f"{url}: {action} failed: {type(exc).__name__}: {exc}") from exc


def join(root: str, *parts: str) -> str:
    return "/".join([root.rstrip("/"), *(p.strip("/") for p in parts)])


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    return isinstance(fs, LocalFileSystem)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_bytes_atomic(url: str, data: bytes) -> None:
    """Write `data` to `url` so that readers see the whole file or nothing."""
    fs, path = filesystem(url)
    if is_local(fs):
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f"{TMP_MARK}{uuid.uuid4().hex}-{os.path.basename(path)}")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.remove(tmp)
            raise
    else:
        # One PUT: S3 makes an object visible only once it is complete.
        with _naming(url, "write"):
            fs.pipe_file(path, data)


def read_bytes(url: str) -> bytes:
    fs, path = filesystem(url)
    if is_local(fs):
        return fs.cat_file(path)
    with _naming(url, "read"):
        return fs.cat_file(path)


def size(url: str) -> int:
    fs, path = filesystem(url)
    with _naming(url, "size"):
        return int(fs.size(path))


def exists(url: str) -> bool:
    fs, path = filesystem(url)
    if is_local(fs):
        return fs.exists(path)
    with _naming(url, "existence check"):
        return fs.exists(path)


def parquet_bytes(table: pa.Table, row_group_size: int | None = None) -> bytes:
    """Parquet bytes with fixed writer settings, so equal tables give equal digests."""
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd", write_statistics=True, store_schema=True,
                   row_group_size=row_group_size)  # fmt: skip
    return sink.getvalue()


def write_parquet_atomic(
    url: str, table: pa.Table, row_group_size: int | None = None
) -> tuple[str, int]:
    """Write a table atomically; returns (sha256 of the file, size in bytes)."""
    data = parquet_bytes(table, row_group_size)
    write_bytes_atomic(url, data)
    return sha256_hex(data), len(data)


def read_parquet(url: str, columns: list[str] | None = None, filters: Any = None) -> pa.Table:
    """A Parquet file's table, or only some columns and the rows `filters` keep (row
    groups whose statistics rule them out are not decoded). A local file is read in
    place, only the column chunks asked for; a remote one with one GET."""
    fs, path = filesystem(url)
    source = path if is_local(fs) else pa.BufferReader(fs.cat_file(path))
    # partitioning=None: a "name=value" folder in the path is not a column here.
    return pq.read_table(source, columns=columns, filters=filters, partitioning=None)


def parquet_file(url: str) -> pq.ParquetFile:
    """A Parquet file opened for reading parts of it: a local file in place, a remote
    one fetched with one GET."""
    fs, path = filesystem(url)
    return pq.ParquetFile(path if is_local(fs) else pa.BufferReader(fs.cat_file(path)))


def list_files(url: str, suffix: str = "") -> list[str]:
    """Complete files under a folder (temporary files skipped), as URLs/paths."""
    fs, path = filesystem(url)
    with _naming(url, "listing"):
        if not fs.exists(path):
            return []
        found = fs.find(path)
    prefix = url.split("://", 1)[0] + "://" if "://" in url else ""
    return sorted(
        prefix + p for p in found if p.endswith(suffix) and TMP_MARK not in os.path.basename(p)
    )


def arrow_bytes(table: pa.Table) -> bytes:
    """One table as an Arrow IPC stream: the blob format of packs (fast for small tables),
    zstd-compressed from COMPRESS_FROM_CELLS on."""
    sink = pa.BufferOutputStream()
    # Explicit options: the default reads environment variables on every call.
    cells = table.num_rows * table.num_columns
    options = _IPC_ZSTD if cells >= COMPRESS_FROM_CELLS else _IPC_OPTIONS
    with ipc.new_stream(sink, table.schema, options=options) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def decode_table(data: bytes) -> pa.Table:
    """A table from Parquet bytes or an Arrow IPC stream (told apart by Parquet's magic)."""
    if data[:4] == PARQUET_MAGIC:
        return pq.read_table(pa.BufferReader(data))
    return ipc.open_stream(pa.BufferReader(data), options=_IPC_READ_OPTIONS).read_all()


def read_range(url: str, offset: int, length: int) -> bytes:
    fs, path = filesystem(url)
    if is_local(fs):
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(length)
    with _naming(url, "read"):
        return fs.cat_file(path, start=offset, end=offset + length)


class BlobReader:
    """Reads blobs, fetching each pack file once: a batch of nodes that read one
    product's days from one pack makes one storage call, not one per node."""

    def __init__(self, max_cached_bytes: int = 256 << 20):
        self.max_cached_bytes = max_cached_bytes
        self._files: dict[str, bytes] = {}
        self._cached = 0

    def read(self, blob: Blob, *, verify: bool = True) -> bytes:
        data = self._files.get(blob.url)
        if data is None:
            data = read_bytes(blob.url)
            if self._cached + len(data) > self.max_cached_bytes:
                self._files.clear()
                self._cached = 0
            self._files[blob.url] = data
            self._cached += len(data)
        part = data[blob.offset : blob.offset + blob.length]
        if verify and sha256_hex(part) != blob.digest:
            raise ValueError(
                f"{blob.url} [{blob.offset}:{blob.offset + blob.length}] does not match its "
                f"digest {blob.digest[:12]}: the stored bytes were changed or truncated"
            )
        return part

    def table(self, blob: Blob, *, verify: bool = True) -> pa.Table:
        return decode_table(self.read(blob, verify=verify))


def read_table(blob: Blob, *, verify: bool = True) -> pa.Table:
    """One blob, checked against its digest."""
    data = read_range(blob.url, blob.offset, blob.length)
    if verify and sha256_hex(data) != blob.digest:
        raise ValueError(
            f"{blob.url} [{blob.offset}:{blob.offset + blob.length}] does not match its "
            f"digest {blob.digest[:12]}: the stored bytes were changed or truncated"
        )
    return decode_table(data)


class PackWriter:
    """Collects tables as Arrow IPC blobs and writes them as one pack file, atomically."""

    def __init__(self, url: str):
        self.url = url
        self._parts: list[bytes] = []
        self._size = 0

    def add(self, table: pa.Table) -> Blob:
        data = arrow_bytes(table)
        blob = Blob(self.url, self._size, len(data), sha256_hex(data))
        self._parts.append(data)
        self._size += len(data)
        return blob

    def __len__(self) -> int:
        return len(self._parts)

    @property
    def size(self) -> int:
        return self._size

    def write(self) -> None:
        if self._parts:
            write_bytes_atomic(self.url, b"".join(self._parts))
