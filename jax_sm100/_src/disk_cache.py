"""The compiled-kernel cache: an in-process dict in front of an on-disk store.

CuTe DSL compiles while JAX lowers, before JAX's own persistent compilation cache is consulted,
so without this cache every new process recompiles every kernel (1.5 to 9 s each on the H200).
`kernel_key.cache_key` (kernel_key.py) names a compiled kernel by everything that changes its
binary; `KernelCache` keeps the compiled bytes under that name, in memory and in a directory
shared by processes. This module needs only the standard library.

Location and size
-----------------
The directory is `$JAX_SM100_CACHE_DIR`, else `$XDG_CACHE_HOME/jax_sm100`, else
`~/.cache/jax_sm100`; `JAX_SM100_CACHE_DIR=off` keeps the cache in memory only. The directory
holds at most `$JAX_SM100_CACHE_MAX_BYTES` (default 2 GiB) of entries: after each write the
least recently used entries (oldest modification time; a disk hit touches its entry) are
deleted until the total fits.

Entry file format
-----------------
One file per key, `<key>.kernel`, where key is 64 lowercase hex digits. All integers are
little-endian:

    offset  size  field
    0       8     magic, b"JSM100KC"
    8       4     format version (uint32), `_FORMAT_VERSION`
    12      4     metadata length M (uint32)
    16      8     payload length P (uint64)
    24      64    the key, ASCII
    88      32    sha256 of bytes [0, 88) + metadata + payload
    120     M     metadata: a JSON object, UTF-8
    120+M   P     payload: opaque bytes (the compiled kernel object)

The digest covers the header, so a flipped bit anywhere, a truncation, an entry stored under
another key or written by another format version is detected on read. Such an entry is logged,
deleted and reported as a miss; it is never returned.

Trust
-----
An entry's payload is a kernel object whose host launch wrapper is native code (x86-64 or
aarch64) that runs in the loading process (ffi/gemm_ffi.cc), so whoever can write the directory
can run code as every user of it. Like ssh with its keys, the cache refuses
(`UntrustedCacheError`) to read an entry from a directory that another user owns or that is
writable by group or others, from any ancestor directory writable by others (a world-writable
sticky one such as /tmp is fine), or from an entry file owned by another user or writable by
group or others. It creates its directory 0700. The default folder (no
`JAX_SM100_CACHE_DIR`) found so is not refused but left alone, with a warning naming the fix:
the cache then holds this process's kernels in memory. A cache shared on purpose (one folder for a
team's jobs) is listed in `$JAX_SM100_TRUSTED_CACHE_DIRS` (os.pathsep-separated): those folders
and everything below them are trusted as they are. The checks need POSIX permissions; elsewhere
they are skipped.

Concurrency
-----------
Writers write a temporary file in the cache directory, fsync it and `os.replace` it over the
entry, so a reader sees either no entry, the old one or the new one, never a torn one; several
processes and threads may fill the same directory at once. `get_or_create` builds a missing
entry once per process (a per-key thread lock) and, where `fcntl` exists, once across processes
(a per-key `<key>.lock` file held while building); neither lock is needed for correctness, only
to avoid compiling the same kernel several times at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import stat
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # Not POSIX: builds across processes are not deduplicated.
    fcntl = None

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "JAX_SM100_CACHE_DIR"
TRUSTED_DIRS_ENV = "JAX_SM100_TRUSTED_CACHE_DIRS"
MAX_BYTES_ENV = "JAX_SM100_CACHE_MAX_BYTES"
DEFAULT_MAX_BYTES = 2 << 30

# Bump when the entry file layout changes.
_FORMAT_VERSION = 1
_MAGIC = b"JSM100KC"
# magic, version, metadata length, payload length, key; the digest follows.
_PREFIX = struct.Struct("<8sIIQ64s")
_DIGEST_SIZE = 32
HEADER_SIZE = _PREFIX.size + _DIGEST_SIZE

_ENTRY_SUFFIX = ".kernel"
_LOCK_SUFFIX = ".lock"
_TMP_PREFIX = ".tmp-"
_KEY_RE = re.compile(r"[0-9a-f]{64}")
# A temporary or lock file this old belongs to a writer that died; an hour is far longer than
# any compile (at most ~10 s each, measured on the H200).
_STALE_S = 3600.0
# How long `get_or_create` waits for another process building the same key before building
# the kernel itself.
_LOCK_TIMEOUT_S = 600.0
_LOCK_POLL_S = 0.05


# ---------------------------------------------------------------------------------------------
# Entries


@dataclasses.dataclass(frozen=True)
class CacheEntry:
    """A compiled kernel as the cache stores it.

    Attributes:
      payload: the compiled object bytes.
      metadata: JSON-able facts about it (function prefix, argument description, PTX text...).
        Stored as JSON, so tuples come back as lists; `KernelCache.put` normalizes it the same
        way, so an entry from memory and one from disk are equal.
    """

    payload: bytes
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.payload, (bytes, bytearray, memoryview)):
            raise TypeError(f"payload must be bytes, got {type(self.payload).__qualname__}")
        if not isinstance(self.metadata, Mapping):
            raise TypeError(f"metadata must be a mapping, got {type(self.metadata).__qualname__}")
        object.__setattr__(self, "payload", bytes(self.payload))


class _CorruptEntry(Exception):
    """An entry file failed verification; the message says how."""


def _metadata_bytes(metadata: Mapping[str, Any]) -> bytes:
    try:
        text = json.dumps(dict(metadata), sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"entry metadata must be JSON-serializable: {e}") from e
    return text.encode("utf-8")


def _encode(key: str, metadata_bytes: bytes, payload: bytes) -> bytes:
    prefix = _PREFIX.pack(
        _MAGIC, _FORMAT_VERSION, len(metadata_bytes), len(payload), key.encode("ascii")
    )
    digest = hashlib.sha256(prefix)
    digest.update(metadata_bytes)
    digest.update(payload)
    return b"".join((prefix, digest.digest(), metadata_bytes, payload))


def _decode(key: str, data: bytes) -> CacheEntry:
    """Verifies an entry file's bytes; raises _CorruptEntry on any mismatch."""
    if len(data) < HEADER_SIZE:
        raise _CorruptEntry(f"truncated header ({len(data)} of {HEADER_SIZE} bytes)")
    magic, version, meta_len, payload_len, stored_key = _PREFIX.unpack_from(data)
    if magic != _MAGIC:
        raise _CorruptEntry(f"bad magic {magic!r}")
    if version != _FORMAT_VERSION:
        raise _CorruptEntry(f"format version {version}, expected {_FORMAT_VERSION}")
    if stored_key != key.encode("ascii"):
        raise _CorruptEntry(f"header names key {stored_key[:16]!r}...")
    expected = HEADER_SIZE + meta_len + payload_len
    if len(data) != expected:
        raise _CorruptEntry(f"{len(data)} bytes, header says {expected}")
    body = memoryview(data)[HEADER_SIZE:]
    digest = hashlib.sha256(memoryview(data)[: _PREFIX.size])
    digest.update(body)
    if digest.digest() != data[_PREFIX.size : HEADER_SIZE]:
        raise _CorruptEntry("sha256 mismatch")
    try:
        metadata = json.loads(bytes(body[:meta_len]).decode("utf-8"))
    except ValueError as e:
        raise _CorruptEntry(f"metadata is not JSON: {e}") from e
    if not isinstance(metadata, dict):
        raise _CorruptEntry("metadata is not a JSON object")
    return CacheEntry(payload=bytes(body[meta_len:]), metadata=metadata)


# ---------------------------------------------------------------------------------------------
# The cache


@dataclasses.dataclass(frozen=True)
class CacheStats:
    """Counters of one `KernelCache` since it was made.

    Attributes:
      memory_hits: lookups answered by the in-process dict.
      disk_hits: lookups answered by a verified entry file.
      misses: lookups answered by neither (for `get_or_create`, the builds).
      writes: entry files written.
      corrupt: entry files that failed verification (each also counts as a miss).
      evictions: entry files deleted to keep the directory within its size bound.
    """

    memory_hits: int = 0
    disk_hits: int = 0
    misses: int = 0
    writes: int = 0
    corrupt: int = 0
    evictions: int = 0


def folder_named_by_env() -> bool:
    """Whether `JAX_SM100_CACHE_DIR` names a folder (set, and not "off"): a folder the user
    chose, refused when untrusted, where the default one is passed over (`KernelCache`,
    `ffi.build`)."""
    value = os.environ.get(CACHE_DIR_ENV, "").strip()
    return bool(value) and value.lower() != "off"


def cache_dir_from_env() -> Path | None:
    """The cache directory the environment asks for; None when `JAX_SM100_CACHE_DIR=off`."""
    value = os.environ.get(CACHE_DIR_ENV, "").strip()
    if value.lower() == "off":
        return None
    if value:
        return Path(value).expanduser()
    return default_cache_dir()


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/jax_sm100`, else `~/.cache/jax_sm100`."""
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(xdg) if xdg and os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "jax_sm100"


def max_bytes_from_env() -> int:
    """The size bound the environment asks for (`JAX_SM100_CACHE_MAX_BYTES`), in bytes.

    Raises:
      ValueError: when the variable is set to anything but a positive integer.
    """
    value = os.environ.get(MAX_BYTES_ENV, "").strip()
    if not value:
        return DEFAULT_MAX_BYTES
    try:
        max_bytes = int(value)
    except ValueError:
        max_bytes = 0
    if max_bytes <= 0:
        raise ValueError(f"{MAX_BYTES_ENV}={value!r} must be a positive number of bytes")
    return max_bytes


def _check_key(key: str) -> None:
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise ValueError(f"{key=} is not a cache key (64 lowercase hex digits, from cache_key)")


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    fields = ("st_dev", "st_ino", "st_size", "st_mtime_ns")
    return all(getattr(a, f) == getattr(b, f) for f in fields)


def _unlink(path: Path) -> bool:
    """Deletes a file another process may delete first; True when this call deleted it."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    except OSError as e:
        logger.warning("jax_sm100 kernel cache: cannot delete %s: %s", path, e)
        return False
    return True


class UntrustedCacheError(PermissionError):
    """A cache folder or entry others could have written; the message says how to fix it."""


def trusted_dirs_from_env() -> tuple[Path, ...]:
    """The folders `JAX_SM100_TRUSTED_CACHE_DIRS` lists (os.pathsep-separated), resolved."""
    value = os.environ.get(TRUSTED_DIRS_ENV, "")
    return tuple(
        Path(os.path.realpath(Path(p.strip()).expanduser()))
        for p in value.split(os.pathsep)
        if p.strip()
    )


def _is_trusted(path: Path) -> bool:
    real = Path(os.path.realpath(path))
    return any(real == t or t in real.parents for t in trusted_dirs_from_env())


def _untrusted(path: Path, why: str, fix: str) -> UntrustedCacheError:
    return UntrustedCacheError(
        f"jax_sm100: refusing to load compiled kernels from {path}: {why}. A kernel-cache entry "
        "holds native host code that runs in this process, so only you may be able to write "
        f"it (as ssh requires of ~/.ssh). Fix: {fix}; or, for a folder shared on purpose, "
        f"list it in {TRUSTED_DIRS_ENV} (os.pathsep-separated)"
    )


def _owner_ok(st: os.stat_result) -> bool:
    return st.st_uid in (os.getuid(), 0)


def check_private_dir(directory: str | os.PathLike) -> None:
    """Refuses a folder others could write, unless `JAX_SM100_TRUSTED_CACHE_DIRS` lists it.

    The folder must be owned by this user (or root) and not writable by group or others; each
    ancestor (of the path as given and of its resolved form) must be owned by this user or
    root and not writable by group or others unless it is sticky (like /tmp).

    Raises:
      UntrustedCacheError: naming the offending folder and the fix.
      FileNotFoundError: the folder does not exist.
    """
    directory = Path(os.path.abspath(os.fspath(directory)))
    if not hasattr(os, "getuid") or _is_trusted(directory):
        return
    st = os.stat(directory)
    if not _owner_ok(st):
        raise _untrusted(
            directory, f"it is owned by uid {st.st_uid}, not by you (uid {os.getuid()})",
            f"use a folder of your own ({CACHE_DIR_ENV}=...)",
        )  # fmt: skip
    if st.st_mode & 0o022:
        raise _untrusted(
            directory, f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})",
            f"chmod go-w {directory}",
        )  # fmt: skip
    real = Path(os.path.realpath(directory))
    for parent in dict.fromkeys([*directory.parents, *real.parents]):
        pst = os.stat(parent)
        # In a sticky folder others may add names but not rename or delete this one.
        sticky = pst.st_mode & stat.S_ISVTX
        if not _owner_ok(pst) or (pst.st_mode & 0o022 and not sticky):
            raise _untrusted(
                directory,
                f"its ancestor {parent} (uid {pst.st_uid}, mode {stat.S_IMODE(pst.st_mode):04o}) "
                "lets others replace it",
                f"chmod go-w {parent}, or a cache folder elsewhere ({CACHE_DIR_ENV}=...)",
            )


def make_private_dir(directory: str | os.PathLike) -> None:
    """Creates `directory` and any missing ancestors 0700 (entries are code: see "Trust");
    folders that exist keep their modes.

    Raises:
      OSError: a folder cannot be created.
    """
    directory = Path(os.path.abspath(os.fspath(directory)))
    missing = [p for p in (directory, *directory.parents) if not p.exists()]
    for p in reversed(missing):
        p.mkdir(mode=0o700, exist_ok=True)


def check_private_file(path: str | os.PathLike, st: os.stat_result) -> None:
    """Refuses a file (stat `st`, from the open descriptor) that another user owns or that
    group or others can write, unless `JAX_SM100_TRUSTED_CACHE_DIRS` lists its folder.

    Raises:
      UntrustedCacheError: naming the file and the fix.
    """
    if not hasattr(os, "getuid") or _is_trusted(Path(path).parent):
        return
    if not _owner_ok(st):
        raise _untrusted(
            Path(path), f"it is owned by uid {st.st_uid}, not by you (uid {os.getuid()})",
            f"delete it (rm {path})",
        )  # fmt: skip
    if st.st_mode & 0o022:
        raise _untrusted(
            Path(path), f"it is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o})",
            f"chmod go-w {path}",
        )  # fmt: skip


class KernelCache:
    """Compiled kernels by key: an in-process dict in front of an on-disk directory.

    Thread-safe; several processes may share one directory. Disk errors (an unwritable or full
    directory) are logged and leave the cache working from memory: the cache never makes a
    compile fail. The in-memory dict is not bounded: it holds the kernels this process uses.
    """

    def __init__(self, directory: str | os.PathLike | None = None, *, max_bytes: int | None = None):
        """Makes a cache; no file is touched until the first lookup.

        Args:
          directory: where entries live; None reads `JAX_SM100_CACHE_DIR` (see the module
            docstring for the default) and "off" keeps the cache in memory only.
          max_bytes: bound on the entries' total size; None reads `JAX_SM100_CACHE_MAX_BYTES`
            (default 2 GiB).

        Raises:
          ValueError: for a non-positive size bound.
        """
        # The default folder (no directory given, none in the environment): where it is not
        # private, the cache warns and runs in memory instead of refusing (`_get_disk`).
        self._default_dir = directory is None and not folder_named_by_env()
        if directory is None:
            self._dir = cache_dir_from_env()
        elif os.fspath(directory).strip().lower() == "off":
            self._dir = None
        else:
            self._dir = Path(directory).expanduser()
        # Absolute, so that processes started in other working directories share it.
        self._dir = None if self._dir is None else self._dir.absolute()
        self._max_bytes = max_bytes_from_env() if max_bytes is None else int(max_bytes)
        if self._max_bytes <= 0:
            raise ValueError(f"max_bytes={max_bytes} must be positive")
        self._lock = threading.Lock()
        self._memory: dict[str, CacheEntry] = {}
        self._build_locks: dict[str, threading.Lock] = {}
        self._counts = {f.name: 0 for f in dataclasses.fields(CacheStats)}
        self._dir_ready = False
        # Set once the disk is given up (a default folder found not private, a folder that
        # cannot be made): `_dir` itself never changes after this, so a thread in the middle
        # of a lookup or write keeps a valid path.
        self._off = False

    def __repr__(self) -> str:
        return f"KernelCache(directory={self.directory!s}, max_bytes={self._max_bytes})"

    @property
    def directory(self) -> Path | None:
        """The entry directory, or None when the cache is memory-only."""
        return None if self._off else self._dir

    @property
    def max_bytes(self) -> int:
        """The bound on the total size of entry files."""
        return self._max_bytes

    def stats(self) -> CacheStats:
        """A snapshot of the counters."""
        with self._lock:
            return CacheStats(**self._counts)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def entry_path(self, key: str) -> Path | None:
        """The file an entry for `key` lives in (None when memory-only)."""
        _check_key(key)
        directory = self.directory
        return None if directory is None else directory / (key + _ENTRY_SUFFIX)

    # -- lookups -------------------------------------------------------------------------------

    def _get_memory(self, key: str) -> CacheEntry | None:
        with self._lock:
            entry = self._memory.get(key)
            if entry is not None:
                self._counts["memory_hits"] += 1
            return entry

    def _get_disk(self, key: str) -> CacheEntry | None:
        """A verified entry from disk (remembered in memory), else None; counts hits only."""
        path = self.entry_path(key)
        if path is None:
            return None
        try:
            check_private_dir(self._dir)
            with open(path, "rb") as f:
                read_stat = os.fstat(f.fileno())
                check_private_file(path, read_stat)
                data = f.read()
        except FileNotFoundError:
            return None
        except UntrustedCacheError as e:
            if not self._default_dir:
                raise  # a folder the user named: refuse it, naming the fix
            self._leave_default(e)
            return None
        except OSError as e:
            logger.warning("jax_sm100 kernel cache: cannot read %s: %s", path, e)
            return None
        try:
            entry = _decode(key, data)
        except _CorruptEntry as e:
            logger.warning(
                "jax_sm100 kernel cache: ignoring and deleting corrupt entry %s: %s", path, e
            )
            self._count("corrupt")
            # Another process may have replaced the bad file with a good one meanwhile (an
            # inode number alone may be reused at once).
            with contextlib.suppress(OSError):
                if _same_file(os.stat(path), read_stat):
                    _unlink(path)
            return None
        # The modification time is the LRU clock.
        with contextlib.suppress(OSError):
            os.utime(path)
        with self._lock:
            self._counts["disk_hits"] += 1
            return self._memory.setdefault(key, entry)

    def get(self, key: str) -> CacheEntry | None:
        """The entry for `key` from memory, else from disk, else None (a miss).

        A second `get` of a key found on disk is answered from memory without touching disk.

        Raises:
          ValueError: when `key` is not 64 lowercase hex digits.
          UntrustedCacheError: the directory or the entry could have been written by another
            user (module docstring, "Trust"); not for the default folder, which the cache then
            leaves for memory, with a warning.
        """
        _check_key(key)
        entry = self._get_memory(key) or self._get_disk(key)
        if entry is None:
            self._count("misses")
        return entry

    # -- stores --------------------------------------------------------------------------------

    def put(self, key: str, entry: CacheEntry) -> CacheEntry:
        """Stores `entry` in memory and on disk, then evicts to stay within the size bound.

        Returns:
          The entry as stored (metadata normalized through JSON), which later lookups return.

        Raises:
          ValueError: when `key` is not 64 lowercase hex digits.
          TypeError: when `entry` is not a `CacheEntry` or its metadata is not JSON-able.
        """
        _check_key(key)
        if not isinstance(entry, CacheEntry):
            raise TypeError(f"expected a CacheEntry, got {type(entry).__qualname__}")
        meta = _metadata_bytes(entry.metadata)
        entry = CacheEntry(payload=entry.payload, metadata=json.loads(meta))
        with self._lock:
            self._memory[key] = entry
        if self.directory is not None:
            blob = _encode(key, meta, entry.payload)
            if len(blob) > self._max_bytes:
                logger.warning(
                    "jax_sm100 kernel cache: %d-byte entry exceeds %s=%d; kept in memory only",
                    len(blob),
                    MAX_BYTES_ENV,
                    self._max_bytes,
                )
            elif self._write(key, blob):
                self._evict(keep=key)
        return entry

    def _leave_default(self, why: UntrustedCacheError) -> None:
        """Gives up the default folder found not private (a group-writable ~/.cache, umask
        002, say): nothing was asked of it, so the job goes on with this process's kernels."""
        logger.warning("jax_sm100 kernel cache: not using the default folder: %s. Caching in "
                       "memory only", why)  # fmt: skip
        self._off = True

    def _ensure_dir(self) -> bool:
        """Creates the directory on first use; if that fails, the cache stays in memory."""
        if self._off:
            return False
        if self._dir_ready:
            return True
        directory = self._dir
        if directory is None:
            return False
        try:
            make_private_dir(directory)
        except OSError as e:
            logger.warning(
                "jax_sm100 kernel cache: cannot create %s (%s); caching in memory only",
                directory,
                e,
            )
            self._off = True
            return False
        if self._default_dir:
            # Decided before anything is written there (`_get_disk` decides it for a folder
            # that a lookup meets first).
            try:
                check_private_dir(directory)
            except UntrustedCacheError as e:
                self._leave_default(e)
                return False
        self._dir_ready = True
        return True

    def _write(self, key: str, blob: bytes) -> bool:
        """Atomically writes an entry file; False (logged) when the disk refuses."""
        if not self._ensure_dir():
            return False
        path = self._dir / (key + _ENTRY_SUFFIX)
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=_ENTRY_SUFFIX, dir=self._dir)
            with os.fdopen(fd, "wb") as f:
                # mkstemp makes 0600 files; entries hold no secrets, and a shared cache
                # directory needs them readable.
                os.fchmod(f.fileno(), 0o644)
                f.write(blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            tmp = None
        except OSError as e:
            logger.warning("jax_sm100 kernel cache: cannot write %s: %s", path, e)
            return False
        finally:
            if tmp is not None:
                _unlink(Path(tmp))
        # Make the rename durable too; not every filesystem can open a directory.
        with contextlib.suppress(OSError):
            dir_fd = os.open(self._dir, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        self._count("writes")
        return True

    def _scan(self) -> list[tuple[float, int, Path]]:
        """(mtime, size, path) of every entry file; sweeps stale temporary and lock files."""
        entries, locks = [], []
        now = time.time()
        try:
            listing = list(os.scandir(self._dir))
        except OSError as e:
            logger.warning("jax_sm100 kernel cache: cannot list %s: %s", self._dir, e)
            return []
        names = {d.name for d in listing}
        for d in listing:
            try:
                st = d.stat(follow_symlinks=False)
            except OSError:  # Deleted by another process since the listing.
                continue
            if d.name.startswith(_TMP_PREFIX):
                if now - st.st_mtime > _STALE_S:
                    _unlink(Path(d.path))
            elif d.name.endswith(_LOCK_SUFFIX):
                locks.append((d, st))
            elif d.name.endswith(_ENTRY_SUFFIX) and _KEY_RE.fullmatch(
                d.name[: -len(_ENTRY_SUFFIX)]
            ):
                entries.append((st.st_mtime, st.st_size, Path(d.path)))
        for d, st in locks:
            entry_name = d.name[: -len(_LOCK_SUFFIX)] + _ENTRY_SUFFIX
            if entry_name not in names and now - st.st_mtime > _STALE_S:
                _unlink(Path(d.path))
        return entries

    def _evict(self, keep: str) -> None:
        """Deletes least recently used entries until the directory fits `max_bytes`."""
        entries = self._scan()
        total = sum(size for _, size, _ in entries)
        if total <= self._max_bytes:
            return
        keep_name = keep + _ENTRY_SUFFIX
        for _, size, path in sorted(entries):
            if total <= self._max_bytes:
                break
            if path.name == keep_name:
                continue
            total -= size
            if _unlink(path):
                self._count("evictions")
                _unlink(path.with_name(path.name[: -len(_ENTRY_SUFFIX)] + _LOCK_SUFFIX))

    # -- build once ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _interprocess_lock(self, key: str) -> Iterator[None]:
        """Holds `<key>.lock` while building, so other processes wait for this build.

        Best effort: without fcntl, a directory or after `_LOCK_TIMEOUT_S`, it yields unlocked.
        """
        if fcntl is None or self.directory is None or not self._ensure_dir():
            yield
            return
        path = self._dir / (key + _LOCK_SUFFIX)
        try:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except PermissionError:
                # Another user's lock in a shared cache (0644): flock needs no write access
                # (where it is local; NFS's emulation wants it, hence read-write first).
                fd = os.open(path, os.O_RDONLY)
        except OSError as e:
            logger.warning("jax_sm100 kernel cache: cannot open lock %s: %s", path, e)
            yield
            return
        try:
            deadline = time.monotonic() + _LOCK_TIMEOUT_S
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        logger.warning(
                            "jax_sm100 kernel cache: waited %.0f s for %s; building anyway",
                            _LOCK_TIMEOUT_S,
                            path,
                        )
                        break
                    time.sleep(_LOCK_POLL_S)
                except OSError:  # A filesystem without flock.
                    break
            yield
        finally:
            os.close(fd)  # Also releases the lock.

    def get_or_create(self, key: str, build_fn: Callable[[], CacheEntry]) -> CacheEntry:
        """The entry for `key` from memory, else disk, else from `build_fn()`, stored.

        Concurrent callers in one process build a key once; with a cache directory, concurrent
        processes do too (they wait for the builder and read its entry). Each call counts one
        memory hit, disk hit or miss.

        Args:
          key: from `cache_key`.
          build_fn: makes the entry (compiles the kernel); called at most once per miss. Its
            exceptions propagate and nothing is stored.

        Returns:
          The entry, as `put` stores it.

        Raises:
          ValueError: when `key` is not 64 lowercase hex digits.
          TypeError: when `build_fn` returns something other than a `CacheEntry`.
          UntrustedCacheError: as for `get`.
        """
        _check_key(key)
        entry = self._get_memory(key)
        if entry is not None:
            return entry
        with self._lock:
            build_lock = self._build_locks.setdefault(key, threading.Lock())
        with build_lock:
            entry = self._get_memory(key) or self._get_disk(key)
            if entry is not None:
                return entry
            with self._interprocess_lock(key):
                entry = self._get_disk(key)
                if entry is not None:
                    return entry
                self._count("misses")
                entry = build_fn()
                if not isinstance(entry, CacheEntry):
                    raise TypeError(
                        f"build_fn must return a CacheEntry, got {type(entry).__qualname__}"
                    )
                return self.put(key, entry)

    def clear(self, *, disk: bool = True) -> None:
        """Forgets every entry in memory and, unless `disk=False`, deletes the entry files.

        The counters are kept. Files of other processes' concurrent writes may survive.
        """
        with self._lock:
            self._memory.clear()
        if not disk or self.directory is None:
            return
        try:
            listing = list(os.scandir(self._dir))
        except FileNotFoundError:
            return
        for d in listing:
            if d.name.endswith((_ENTRY_SUFFIX, _LOCK_SUFFIX)) or d.name.startswith(_TMP_PREFIX):
                _unlink(Path(d.path))


# ---------------------------------------------------------------------------------------------
# The process-wide cache

_default_cache: KernelCache | None = None
_default_cache_lock = threading.Lock()


def default_cache() -> KernelCache:
    """The process-wide cache, configured from the environment on first use."""
    global _default_cache
    with _default_cache_lock:
        if _default_cache is None:
            _default_cache = KernelCache()
        return _default_cache


def get_or_create(key: str, build_fn: Callable[[], CacheEntry]) -> CacheEntry:
    """`default_cache().get_or_create(key, build_fn)`; see `KernelCache.get_or_create`."""
    return default_cache().get_or_create(key, build_fn)
