"""Where checkpoint bytes live: a local path or an fsspec URL (``s3://bucket/prefix``, ``gs://``, ...).

Every place in ckptq that opens, sizes, lists or removes checkpoint files goes through this module,
so each accepts a URL wherever it accepts a path. Local paths keep the operating system's calls
(``pread``, ``copy_file_range``, ``rename``); URLs go to the fsspec file system their protocol
names (``fsspec.core.url_to_fs``; ``s3fs`` for ``s3://``), imported on first use only: neither
fsspec nor s3fs is needed to import ckptq.

What object stores change (and what ckptq does about it):

* **No rename, no partial writes.** An object appears whole when its upload completes (one PUT, or
  the completion of a multipart upload) or not at all; it cannot be renamed atomically or written
  at an offset. So a checkpoint on an object store is written in place under its final prefix,
  data objects first, ``.metadata`` last (one PUT): readers see no checkpoint until ``.metadata``
  exists, and a writer killed midway leaves data objects (or unfinished multipart uploads) but
  no ``.metadata`` -- nothing any ckptq reader or ``dcp.load`` accepts.
* **No atomic replace of a prefix.** Saving over an existing checkpoint cannot swap it as the local
  rename does. ckptq refuses unless asked (``overwrite``): then ``.metadata`` of the old checkpoint
  is deleted *first* (it stops being a checkpoint at once), then its other objects, then the new
  one is written. Between the two, there is no checkpoint at that prefix. To keep the old one until
  the new one is complete, save each version under a new prefix (``.../step-1000``) and delete old
  prefixes after.
* **Ranged reads.** ``dcp.load`` fetches the records of a data object it reads in order, those
  next to each other together, in ranged GETs of up to :data:`READ_WINDOW` bytes with
  :data:`READ_AHEAD_WINDOWS` of them in flight (:class:`RangePrefetcher`). A tool fetches each
  record (or each payload it copies) by its exact byte range (one ranged GET: :func:`read_range`,
  :meth:`RangeReader.readinto`), record headers through a small block cache (:data:`READ_BLOCK`).
  Nothing reads more than it needs, and nothing copies a whole checkpoint to local disk.
* **Whole-object writes.** ``dcp.save`` builds each data object in memory (at most about
  :data:`OBJECT_BYTES`; a rank's records are spread over as many objects as that takes) and
  uploads it with the file system's ``pipe_file`` (:func:`put_object`; s3fs: one PUT, or a
  multipart upload of concurrent parts). The offline tools stream their data files (s3fs uploads
  each :data:`WRITE_BLOCK` bytes as one part of a multipart upload, a smaller file with one PUT at
  close).

Credentials and endpoints come from the usual places of the file system's library (for S3:
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_ENDPOINT_URL``, ``~/.aws``, instance
roles), from fsspec's configuration (``FSSPEC_S3_ENDPOINT_URL``, ``~/.config/fsspec``), or from
:func:`set_storage_options`. ckptq never logs or prints them: messages name URLs only.
"""

from __future__ import annotations

import io
import os
import shutil
from pathlib import Path
from typing import Any, Union

from ..errors import CkptqError

__all__ = [
    "is_url",
    "location",
    "join",
    "name_of",
    "parent_of",
    "filesystem",
    "file_size",
    "open_file",
    "RangeReader",
    "RangePrefetcher",
    "read_range",
    "read_ranges",
    "put_object",
    "discard",
    "dcp_filesystem",
    "list_names",
    "remove_tree",
    "set_storage_options",
    "READ_BLOCK",
    "READ_WINDOW",
    "READ_AHEAD_WINDOWS",
    "WRITE_BLOCK",
    "OBJECT_BYTES",
]

PathLike = Union[str, "os.PathLike[str]"]

#: Bytes per request of a data file opened for small structural reads (record headers and zip
#: directories; fsspec's block cache keeps the blocks read). Payloads are read by exact byte range.
READ_BLOCK = 256 << 10
#: Bytes per part of a multipart upload of a data file a tool streams (S3 needs parts of at least 5 MiB).
WRITE_BLOCK = 64 << 20
#: Bytes of a data object ``dcp.save`` builds in memory before it uploads it whole (about: a rank's
#: records are spread over ``ceil(bytes / OBJECT_BYTES)`` objects, or more; a record larger than
#: this is an object of its own size).
OBJECT_BYTES = 512 << 20
#: Bytes of one ranged GET of :class:`RangePrefetcher` (records next to each other share one).
READ_WINDOW = 64 << 20
#: Ranged GETs :class:`RangePrefetcher` keeps in flight (its memory: this many windows, plus the
#: one being read).
READ_AHEAD_WINDOWS = 2

_OPTIONS: dict[str, dict] = {}


def is_url(path: Any) -> bool:
    """Whether ``path`` is a URL of a remote file system (``proto://...``, except ``file://``)."""
    if not isinstance(path, str) or "://" not in path:
        return False
    return path.split("://", 1)[0] not in ("", "file")


def location(path: PathLike) -> str | Path:
    """``path`` as the tools keep it: a URL string without trailing ``/``, or an absolute ``Path``
    (``file://`` URLs become paths)."""
    if is_url(path):
        return str(path).rstrip("/")
    if isinstance(path, str) and path.startswith("file://"):
        path = path[len("file://") :]
    return Path(path).absolute()


def join(base: PathLike, rel: str) -> str | Path:
    """``rel`` (a relative name with ``/`` separators) under ``base``."""
    if is_url(base):
        return str(base).rstrip("/") + "/" + str(rel)
    return Path(base) / rel


def name_of(path: PathLike) -> str:
    """The last component of ``path``."""
    return str(path).rstrip("/").rsplit("/", 1)[-1] if is_url(path) else Path(path).name


def parent_of(path: PathLike) -> str | Path:
    """The folder (prefix) holding ``path``."""
    return str(path).rstrip("/").rsplit("/", 1)[0] if is_url(path) else Path(path).parent


def set_storage_options(protocol: str, **options: Any) -> None:
    """Options for the fsspec file system of ``protocol`` (e.g. ``"s3"``: ``endpoint_url=``,
    ``key=``, ``secret=``, ``client_kwargs=``), used by every later :func:`filesystem` call; they
    are passed to the file system's constructor, never logged. Without it, the library's own
    defaults (environment variables, config files) apply."""
    _OPTIONS[protocol] = dict(options)


def filesystem(url: str) -> tuple[Any, str]:
    """``(fsspec file system, path inside it)`` for ``url`` (``fsspec.core.url_to_fs`` with the
    options of :func:`set_storage_options`).

    Raises:
        CkptqError: fsspec, or the library of the URL's protocol (``s3fs`` for ``s3://``), is not
            installed (``pip install 'ckptq[s3]'``).
    """
    protocol = url.split("://", 1)[0]
    try:
        from fsspec.core import url_to_fs

        return url_to_fs(url, **_OPTIONS.get(protocol, {}))
    except ImportError as e:
        raise CkptqError(
            f"{url}: reading or writing {protocol}:// URLs needs fsspec and its {protocol} file system "
            f"({e}); install them, e.g. pip install 'ckptq[s3]' for s3://"
        ) from None


def file_size(path: PathLike) -> int | None:
    """Bytes of the file (object) ``path``, or None if there is none.

    Raises:
        CkptqError: the object store refused or failed the request (credentials, endpoint, network);
            the message names the URL and the server's error, never the credentials."""
    if not is_url(path):
        try:
            st = os.stat(path)
        except OSError:
            return None
        import stat

        return st.st_size if stat.S_ISREG(st.st_mode) else None
    fs, p = filesystem(str(path))
    try:
        info = fs.info(p)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CkptqError(
            f"{path}: the object store refused or failed the request ({type(e).__name__}: {e}); check the "
            f"endpoint and credentials (for s3://: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ... or fsspec's options)"
        ) from None
    return int(info["size"]) if info.get("type") == "file" else None


def open_file(path: PathLike, mode: str = "rb", *, block_size: int | None = None) -> Any:
    """Open ``path`` (``"rb"``, ``"wb"``, ``"r"``, ``"w"``). For URLs, a read-only file reads by
    byte range in blocks of :data:`READ_BLOCK` (kept in fsspec's block cache: for small reads such
    as record headers; fetch payloads with :func:`read_range`), and a file opened for writing
    uploads as it goes (multipart parts of :data:`WRITE_BLOCK`): the object appears when it is closed."""
    if not is_url(path):
        return open(path, mode)
    fs, p = filesystem(str(path))
    if "r" in mode:
        return fs.open(p, mode, block_size=block_size or READ_BLOCK, cache_type="blockcache")
    return fs.open(p, mode, block_size=block_size or WRITE_BLOCK)


class _Range(io.BytesIO):
    """Bytes ``base ..`` of a file, held in memory, addressed by their offsets in the file."""

    def __init__(self, data: bytes, base: int) -> None:
        super().__init__(data)
        self._base = base

    def seek(self, pos: int, whence: int = 0) -> int:
        return super().seek(pos - self._base if whence == 0 else pos, whence) + self._base

    def tell(self) -> int:
        return super().tell() + self._base


def read_range(path: PathLike, start: int, end: int) -> io.BytesIO:
    """Bytes ``start .. end`` of file ``path`` (fewer if it ends first: never more memory than the
    file holds), fetched at once (one ranged GET for URLs), as a seekable stream addressed by file
    offsets (``seek(start)`` is its first byte).

    Raises:
        OSError (FileNotFoundError): no such file."""
    if is_url(path):
        fs, p = filesystem(str(path))
        try:  # the server sends what the object holds of the range
            data = fs.cat_file(p, start=start, end=end) if end > start else b""
        except OSError:
            if file_size(path) is None:
                raise
            data = b""  # a range starting at or past the end
    else:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            data = os.pread(f.fileno(), max(0, min(end, size) - start), start)
    return _Range(data, start)


def put_object(url: str, data: bytes) -> None:
    """Upload ``data`` as the whole object ``url`` (the file system's ``pipe_file``; s3fs 2026.9:
    one PUT below 100 MiB, else a multipart upload of 50 MiB parts, 10 at once). The object
    appears when the upload completes, or not at all (s3fs aborts a failed multipart upload).
    ``bytes``, not a ``bytearray`` or ``memoryview``: botocore 1.43 refuses a memoryview body and
    sent a bytearray slower than bytes (a 66 MB PUT to moto, 1.4-1.8 s against 1.0-1.4 s).

    Raises:
        OSError: the object store refused or failed the upload."""
    fs, p = filesystem(url)
    fs.pipe_file(p, data)


class RangePrefetcher:
    """Byte ranges of one object, fetched ahead in file order, served from memory.

    ``ranges`` (``(start, end)`` byte ranges, e.g. the records a reader will read) are covered by
    windows: ranges in file order, one after another while the gap between them is at most
    ``gap`` bytes (default :data:`READ_BLOCK`) and the window at most ``window`` bytes (default
    :data:`READ_WINDOW`; a longer range is split). Each window is one ranged GET (the file
    system's ``cat_file`` with ``start`` / ``end``), ``ahead`` of them (default
    :data:`READ_AHEAD_WINDOWS`) in flight on threads. :meth:`pread` / :meth:`readinto` must come
    in ascending file positions: a window is dropped once a read starts past its end; a read
    outside every window is fetched by itself. Memory: at most ``ahead + 1`` windows.

    Not thread-safe (one reader thread); :meth:`close` stops it.
    """

    def __init__(
        self,
        url: str,
        ranges: list[tuple[int, int]],
        *,
        window: int | None = None,
        ahead: int | None = None,
        gap: int | None = None,
    ) -> None:
        import collections
        import concurrent.futures as cf

        self.url = url
        self._fs, self._path = filesystem(url)
        window = READ_WINDOW if window is None else window
        self.windows = _windows(ranges, max(1, int(window)), max(0, int(READ_BLOCK if gap is None else gap)))
        self._todo = collections.deque(self.windows)
        self._held: collections.deque = collections.deque()  # (start, end, future of the bytes)
        self._ahead = max(1, int(READ_AHEAD_WINDOWS if ahead is None else ahead))
        self._pool = cf.ThreadPoolExecutor(self._ahead, thread_name_prefix="ckptq-get")
        self._fill()

    def _get(self, start: int, end: int) -> bytes:
        try:  # one ranged GET; the server sends what the object holds of the range
            return self._fs.cat_file(self._path, start=start, end=end)
        except OSError:
            size = file_size(self.url)
            if size is None or start < size:
                raise
            return b""  # a range starting at or past the end

    def _fill(self) -> None:
        while self._todo and len(self._held) <= self._ahead:
            start, end = self._todo.popleft()
            self._held.append((start, end, self._pool.submit(self._get, start, end)))

    def _window_at(self, pos: int) -> tuple[int, bytes] | None:
        while self._held and self._held[0][1] <= pos:  # read past: dropped
            self._held.popleft()[2].cancel()
        while self._todo and self._todo[0][1] <= pos:  # skipped by the reader: never fetched
            self._todo.popleft()
        self._fill()
        if self._held and self._held[0][0] <= pos:
            return self._held[0][0], self._held[0][2].result()
        return None

    def readinto(self, buf: Any, pos: int) -> int:
        """Fill the writable bytes-like ``buf`` from byte ``pos`` of the object; returns the bytes
        read (fewer only where the object ends)."""
        view = memoryview(buf).cast("B")
        done = 0
        while done < len(view):
            at = pos + done
            found = self._window_at(at)
            if found is None:  # not prefetched: its own ranged GET
                data = self._get(at, pos + len(view))
                view[done : done + len(data)] = data
                return done + len(data)
            start, data = found
            n = min(len(view) - done, len(data) - (at - start))
            if n <= 0:
                break  # the object ends inside this window
            view[done : done + n] = memoryview(data)[at - start : at - start + n]
            done += n
        return done

    def pread(self, n: int, pos: int) -> bytes:
        """Up to ``n`` bytes at byte ``pos`` (fewer only where the object ends)."""
        buf = bytearray(n)
        return bytes(buf[: self.readinto(buf, pos)])

    def close(self) -> None:
        for _, _, fut in self._held:
            fut.cancel()
        self._held.clear()
        self._todo.clear()
        self._pool.shutdown(wait=True)


def read_ranges(root: str, ranges: list[tuple[str, int, int]], *, window: int = 8 << 20) -> list[bytes | None]:
    """Bytes ``start .. end`` of object ``rel`` under the URL ``root`` for each ``(rel, start, end)``
    of ``ranges``, fetched together: ranges of one object within :data:`READ_BLOCK` bytes of each
    other share a ranged GET of at most ``window`` bytes, and the GETs run concurrently (the file
    system's ``cat_ranges``), 16 at a time. None for a range the object does not hold whole or
    whose GET failed (the caller reads it alone, to name the problem)."""
    import bisect

    fs, base = filesystem(root)
    base = base.rstrip("/")
    out: list[bytes | None] = [None] * len(ranges)
    by_rel: dict[str, list[tuple[int, int, int]]] = {}
    for i, (rel, start, end) in enumerate(ranges):
        if 0 <= start <= end:
            by_rel.setdefault(rel, []).append((start, end, i))
    jobs: list[tuple[str, int, int, list]] = []  # (path, window start, window end, its ranges)
    for rel, spans in by_rel.items():
        wins = _windows([(s, e) for s, e, _ in spans], max(1, window), READ_BLOCK)
        starts = [w[0] for w in wins]
        mine: dict[int, list] = {}
        for s, e, i in spans:
            k = bisect.bisect_right(starts, s) - 1
            if k >= 0 and e <= wins[k][1]:  # else split over windows: left to the caller
                mine.setdefault(k, []).append((s, e, i))
        jobs += [(f"{base}/{rel}", wins[k][0], wins[k][1], rs) for k, rs in mine.items()]
    for b in range(0, len(jobs), 16):
        batch = jobs[b : b + 16]
        got = fs.cat_ranges([j[0] for j in batch], [j[1] for j in batch], [j[2] for j in batch], on_error="return")
        for (_, ws, _, rs), data in zip(batch, got, strict=True):
            if not isinstance(data, (bytes, bytearray)):
                continue
            for s, e, i in rs:
                if e - ws <= len(data):
                    out[i] = bytes(data[s - ws : e - ws])
    return out


def _windows(ranges: list[tuple[int, int]], window: int, gap: int) -> list[tuple[int, int]]:
    """The windows of :class:`RangePrefetcher` covering ``ranges``."""
    out: list[list[int]] = []
    for s, e in sorted(ranges):
        if out and s < out[-1][1]:
            s = out[-1][1]  # overlapping ranges: the part not covered yet
        if e <= s:
            continue
        if out and s - out[-1][1] <= gap and e - out[-1][0] <= window:
            out[-1][1] = e
            continue
        while e - s > window:
            out.append([s, s + window])
            s += window
        out.append([s, e])
    return [(s, e) for s, e in out]


def discard(f: Any) -> None:
    """Close a file opened for writing by :func:`open_file` without publishing it where the file
    system allows (an object store's upload is aborted; a local file is closed as written)."""
    drop = getattr(f, "discard", None)
    if drop is not None and hasattr(f, "fs"):
        drop()
        f.closed = True  # fsspec: the buffer is gone; close() must not upload
    else:
        f.close()


class RangeReader:
    """Reads byte ranges of the files of one checkpoint into caller buffers (``pread`` locally, one
    ranged GET each for URLs); keeps each local file open until :meth:`close`.

    Not thread-safe."""

    def __init__(self, root: PathLike) -> None:
        self.root = root
        self.remote = is_url(root)
        self._open: dict[str, Any] = {}

    def fd(self, rel: str) -> int:
        """An OS file descriptor of local file ``rel`` (for ``copy_file_range``)."""
        assert not self.remote, "object stores have no file descriptors"
        f = self._open.get(rel)
        if f is None:
            f = self._open[rel] = os.open(join(self.root, rel), os.O_RDONLY)
        return f

    def handle(self, rel: str) -> Any:
        """The open file ``rel`` (a file object for URLs; an OS descriptor locally)."""
        if not self.remote:
            return self.fd(rel)
        f = self._open.get(rel)
        if f is None:
            f = self._open[rel] = open_file(join(self.root, rel), "rb")
        return f

    def readinto(self, rel: str, into: memoryview, pos: int) -> int:
        """Read up to ``len(into)`` bytes at byte ``pos`` of ``rel`` into ``into``; returns how many
        (0: end of file)."""
        if not self.remote:
            return os.preadv(self.fd(rel), [into], pos)
        fs, p = filesystem(str(join(self.root, rel)))
        data = fs.cat_file(p, start=pos, end=pos + len(into))  # one ranged GET, no cache
        into[: len(data)] = data
        return len(data)

    def close(self) -> None:
        for f in self._open.values():
            if isinstance(f, int):
                os.close(f)
            else:
                f.close()
        self._open.clear()


def list_names(path: PathLike) -> list[str]:
    """Names of the files directly under folder (prefix) ``path`` ([] if none)."""
    if not is_url(path):
        p = Path(path)
        return sorted(c.name for c in p.iterdir()) if p.is_dir() else []
    fs, p = filesystem(str(path))
    try:
        return sorted(str(n).rstrip("/").rsplit("/", 1)[-1] for n in fs.ls(p, detail=False, refresh=True))
    except FileNotFoundError:
        return []


def remove_tree(path: PathLike, *, first: tuple[str, ...] = ()) -> None:
    """Remove folder (prefix) ``path`` and everything under it, if it exists. The files named in
    ``first`` (``.metadata``; an export's ``config.json``: what makes the folder a checkpoint) go
    first, one by one, so it stops being one before any of its data goes."""
    if not is_url(path):
        for name in first:
            if (Path(path) / name).is_file():
                os.unlink(Path(path) / name)
        shutil.rmtree(path, ignore_errors=True)
        return
    fs, p = filesystem(str(path))
    for name in first:
        try:
            fs.rm_file(p.rstrip("/") + "/" + name)
        except FileNotFoundError:
            pass
    try:
        fs.rm(p, recursive=True)
    except FileNotFoundError:
        pass
    fs.invalidate_cache(p)


def dcp_filesystem(url: str) -> tuple[Any, str]:
    """DCP's own fsspec ``FileSystemBase`` (``torch.distributed.checkpoint._fsspec_filesystem``,
    what ``FsspecWriter`` / ``FsspecReader`` use) bound to ``url``, and the path DCP keeps: for
    ckptq's ``dcp.save`` / ``dcp.load`` storage writer and reader on URLs."""
    fs, _ = filesystem(url)  # the clear error when fsspec or the protocol's library is missing
    from torch.distributed.checkpoint._fsspec_filesystem import FileSystem

    dcp_fs = FileSystem()
    dcp_fs.fs = fs
    return dcp_fs, url.rstrip("/")
