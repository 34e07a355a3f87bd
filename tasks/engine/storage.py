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
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
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


def _row_group_buffer(field: pa.Field, rows: int) -> tuple[np.ndarray, np.ndarray | None] | None:
    """A number or bool column's buffers for a row group (its values; whether each is
    valid, for a nullable column); None for other types."""
    kind = field.type
    if not (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)):
        return None
    dtype = bool if pa.types.is_boolean(kind) else kind.to_pandas_dtype()
    return np.empty(rows, dtype), np.empty(rows, bool) if field.nullable else None


def sha256_range(url: str, offset: int = 0, length: int | None = None) -> str:
    """The sha256 of a file, or of `length` bytes of it from `offset`, read 8 MiB at a time:
    checking a landed day costs a block, not the file."""
    sha, block = hashlib.sha256(), 8 << 20
    fs, path = filesystem(url)
    if not is_local(fs) and length is not None and length <= block:
        return sha256_hex(read_range(url, offset, length))  # one GET (a blob of a pack)
    with contextlib.ExitStack() as stack:
        if not is_local(fs):
            stack.enter_context(_naming(url, "read"))
        f = stack.enter_context(open(path, "rb") if is_local(fs) else fs.open(path, "rb"))
        f.seek(offset)
        left = length
        while left is None or left > 0:
            data = f.read(block if left is None else min(block, left))
            if not data:
                break
            sha.update(data)
            if left is not None:
                left -= len(data)
    return sha.hexdigest()


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


# The writer settings of every Parquet file stored here: a change changes every digest.
_PARQUET_OPTIONS: dict[str, Any] = {"compression": "zstd", "write_statistics": True,
                                    "store_schema": True}  # fmt: skip
# pyarrow's row group size when none is given (write_table's row_group_size=None: at most
# 1024 * 1024 rows): the row groups of every landed day so far, which ParquetStream keeps.
PARQUET_ROW_GROUP_ROWS = 1024 * 1024


def parquet_bytes(table: pa.Table, row_group_size: int | None = None) -> bytes:
    """Parquet bytes with fixed writer settings, so equal tables give equal digests."""
    sink = io.BytesIO()
    pq.write_table(table, sink, row_group_size=row_group_size, **_PARQUET_OPTIONS)
    return sink.getvalue()


class _Hashed:
    """A binary file that hashes what is written to it (the Parquet writer only appends)."""

    def __init__(self, file: io.BufferedWriter):
        self._file, self.sha256, self.size, self.closed = file, hashlib.sha256(), 0, False
        self.dropped = (
            False  # discarded: the writer's footer, written as it is closed, goes nowhere
        )

    def write(self, data: bytes) -> int:
        if self.dropped:
            return len(data)
        self._file.write(data)
        self.sha256.update(data)
        self.size += len(data)
        return len(data)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self._file.flush()

    def writable(self) -> bool:
        return True

    def close(self) -> None:  # the writer closes its sink; the file is closed by its owner
        self.closed = True


class ParquetStream:
    """A Parquet file written block by block, byte for byte what `parquet_bytes` writes for
    the whole table, so the same digest: the same settings, the same row groups (blocks
    gathered into row groups of `row_group_size` rows) and one chunk per column in each,
    as slices of a whole table's one-chunk columns are. Chunks cut elsewhere change the
    bytes: Arrow checks a column's dictionary size (falling back to plain encoding) per
    chunk it is handed, so a day's `time` column came out 32 kB larger from its blocks.

    A number or bool column is copied block by block into one preallocated buffer of a row
    group (so a row group is held once: a 1-level LOBSTER row is 66 bytes, 1024 * 1024 of
    them 69 MB); another type keeps its blocks and joins them at the row group's end.

    Written under a temporary name in `folder` (a remote store: a local temporary file),
    hashed as it is written; `publish(url)` renames it into place (uploads it), `discard()`
    removes it and any folder it made. Nothing is under a final name before publish.
    """

    def __init__(
        self, folder: str, schema: pa.Schema, row_group_size: int = PARQUET_ROW_GROUP_ROWS
    ):
        if row_group_size < 1:
            raise ValueError(f"ParquetStream row_group_size must be >= 1, got {row_group_size}")
        self.folder, self.schema, self.row_group_size = folder, schema, row_group_size
        self.rows = 0
        self.digest: str | None = None  # set by finish()
        self.size = 0
        # per column: (values, valid) buffers of a row group, or None (blocks joined)
        self._buffers: list[tuple[np.ndarray, np.ndarray | None] | None] | None = None
        self._parts: list[list[pa.Array]] = [[] for _ in schema]
        self._pending_rows = 0
        self._tmp: str | None = None
        self._created: list[str] = []  # folders this stream made, deepest last
        self._file: io.BufferedWriter | None = None
        self._hashed: _Hashed | None = None
        self._writer: pq.ParquetWriter | None = None

    def write(self, block: pa.Table | pa.RecordBatch) -> None:
        """Append rows (a table or record batch of `schema`)."""
        if self.digest is not None:
            raise RuntimeError("ParquetStream.write after finish")
        if not block.schema.equals(self.schema):
            raise ValueError(f"block schema differs from the stream's:\n{block.schema}")
        if self._buffers is None:  # allocated with the first rows: a day's size is unknown
            self._buffers = [_row_group_buffer(f, self.row_group_size) for f in self.schema]
        taken = 0
        while taken < block.num_rows:
            n = min(block.num_rows - taken, self.row_group_size - self._pending_rows)
            piece = block.slice(taken, n)
            at = slice(self._pending_rows, self._pending_rows + n)
            for buffer, parts, column in zip(self._buffers, self._parts, piece.columns,
                                             strict=True):  # fmt: skip
                chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
                if buffer is None:
                    parts.extend(chunks)
                    continue
                values, valid = buffer
                start = at.start
                for chunk in chunks:
                    rows = slice(start, start + len(chunk))
                    if valid is not None:
                        valid[rows] = chunk.is_valid().to_numpy(zero_copy_only=False)
                        chunk = pc.fill_null(chunk, False if values.dtype == bool else 0)
                    values[rows] = chunk.to_numpy(zero_copy_only=False)
                    start += len(chunk)
            self._pending_rows += n
            taken += n
            if self._pending_rows == self.row_group_size:
                self._flush()

    def _flush(self) -> None:
        if self._writer is None:
            self._open()
        n = self._pending_rows
        columns = []
        for i, field in enumerate(self.schema):
            buffer = self._buffers[i] if self._buffers else None
            if buffer is None:  # a column's blocks dropped as it is joined
                parts, self._parts[i] = self._parts[i], []
                columns.append(pa.concat_arrays(parts) if parts else pa.array([], field.type))
                continue
            values, valid = buffer
            mask = None if valid is None or valid[:n].all() else ~valid[:n]
            # numbers: the buffer itself (no copy); bools: packed into bits
            columns.append(pa.array(values[:n], type=field.type, mask=mask))
        table = pa.Table.from_arrays(columns, schema=self.schema)
        assert self._writer is not None
        self._writer.write_table(table, row_group_size=self.row_group_size)
        self.rows += n
        self._pending_rows = 0

    def _open(self) -> None:
        fs, path = filesystem(self.folder)
        name = f"{TMP_MARK}{uuid.uuid4().hex}.parquet"
        if is_local(fs):
            missing, folder = [], path
            while not os.path.isdir(folder):
                missing.append(folder)
                folder = os.path.dirname(folder)
            os.makedirs(path, exist_ok=True)
            self._created = missing[::-1]
            self._tmp = os.path.join(path, name)
        else:  # published with one upload, visible only once complete
            self._tmp = os.path.join(tempfile.gettempdir(), name)
        self._file = open(self._tmp, "wb")  # noqa: SIM115 - closed by finish or discard
        self._hashed = _Hashed(self._file)
        self._writer = pq.ParquetWriter(self._hashed, self.schema, **_PARQUET_OPTIONS)

    def finish(self) -> tuple[str, int]:
        """Write what is held and the footer; returns (sha256, size) of the file."""
        if self.digest is None:
            if self._pending_rows or self._writer is None:
                self._flush()  # the last row group (an empty table: an empty file, as whole)
            self._buffers = None  # a finished day waiting to land holds no rows
            assert self._writer is not None and self._file is not None
            self._writer.close()
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            assert self._hashed is not None
            self.digest, self.size = self._hashed.sha256.hexdigest(), self._hashed.size
        return self.digest, self.size

    def publish(self, url: str) -> None:
        """Put the finished file at `url` (atomically: a rename, or one upload)."""
        self.finish()
        assert self._tmp is not None
        fs, path = filesystem(url)
        if is_local(fs):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            os.replace(self._tmp, path)
        else:
            with _naming(url, "write"):
                fs.put_file(self._tmp, path)
            os.remove(self._tmp)
        self._tmp, self._created = None, []

    def discard(self) -> None:
        """Remove the temporary file (and the folders made for it); a no-op once published."""
        if self._writer is not None and self.digest is None:
            assert self._hashed is not None
            self._hashed.dropped = True
            self._writer.close()
        self._writer = None
        if self._file is not None and not self._file.closed:
            self._file.close()
        if self._tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._tmp)
            self._tmp = None
        for folder in reversed(self._created):  # only if still empty: another may use it
            try:
                os.rmdir(folder)
            except OSError:
                break
        self._created = []
        self._buffers, self._parts = None, [[] for _ in self.schema]


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
        if not is_local(fs):
            # s3fs keeps folder listings, and find() does not replace one it has: a file
            # another process wrote since would be listed, then not found when read
            fs.invalidate_cache(path)
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
