"""Tests of the compiled-kernel cache: hits and misses, corruption, concurrency, bounds.

The key itself is tested in test_kernel_key.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from unittest import mock

from absl.testing import absltest, parameterized

from jax_sm100._src import disk_cache
from tests import test_util as tu

REPO_ROOT = Path(__file__).resolve().parents[1]


def _key(i) -> str:
    return hashlib.sha256(f"key {i}".encode()).hexdigest()


def _entry(i, size: int = 1000) -> disk_cache.CacheEntry:
    payload = random.Random(str(i)).randbytes(size)
    return disk_cache.CacheEntry(payload, {"prefix": f"kernel_{i:>4}", "args": ["a", "b", "d"]})


class KernelCacheTest(parameterized.TestCase):
    def setUp(self):
        super().setUp()
        self.dir = Path(self.enterContext(tempfile.TemporaryDirectory()))

    def _cache(self, **kwargs) -> disk_cache.KernelCache:
        return disk_cache.KernelCache(self.dir, **kwargs)

    def _stats(self, cache, **expected):
        return dataclasses.replace(disk_cache.CacheStats(), **expected), cache.stats()

    def test_hit_miss_accounting(self):
        key, entry = _key(0), _entry(0)
        first = self._cache()
        self.assertIsNone(first.get(key))
        first.put(key, entry)
        self.assertEqual(first.get(key), entry)
        self.assertEqual(*self._stats(first, misses=1, writes=1, memory_hits=1))

        second = self._cache()  # A new process: empty memory, same directory.
        self.assertEqual(second.get(key), entry)
        self.assertEqual(second.get(key), entry)
        self.assertIsNone(second.get(_key(1)))
        self.assertEqual(*self._stats(second, disk_hits=1, memory_hits=1, misses=1))

    def test_memory_hit_touches_no_disk(self):
        key = _key(0)
        self._cache().put(key, _entry(0))
        cache = self._cache()
        self.assertIsNotNone(cache.get(key))
        cache.entry_path(key).unlink()
        with (
            mock.patch("builtins.open", side_effect=AssertionError("disk read")),
            mock.patch.object(os, "utime", side_effect=AssertionError("disk touch")),
        ):
            self.assertEqual(cache.get(key), _entry(0))
            self.assertEqual(cache.get_or_create(key, lambda: self.fail("built")), _entry(0))
        self.assertEqual(cache.stats().memory_hits, 2)

    def test_get_or_create_builds_once_then_hits(self):
        calls = []

        def build():
            calls.append(1)
            return _entry(0)

        cache = self._cache()
        self.assertEqual(cache.get_or_create(_key(0), build), _entry(0))
        self.assertEqual(cache.get_or_create(_key(0), build), _entry(0))
        self.assertEqual(self._cache().get_or_create(_key(0), build), _entry(0))
        self.assertLen(calls, 1)
        self.assertEqual(*self._stats(cache, misses=1, writes=1, memory_hits=1))

    def test_build_failure_stores_nothing(self):
        cache = self._cache()
        with self.assertRaisesRegex(RuntimeError, "compile failed"):
            cache.get_or_create(_key(0), mock.Mock(side_effect=RuntimeError("compile failed")))
        self.assertIsNone(self._cache().get(_key(0)))
        self.assertEqual(cache.get_or_create(_key(0), lambda: _entry(0)), _entry(0))

    def test_build_must_return_an_entry(self):
        with self.assertRaisesRegex(TypeError, "CacheEntry"):
            self._cache().get_or_create(_key(0), lambda: b"object bytes")

    def test_metadata_round_trips_through_json(self):
        entry = disk_cache.CacheEntry(b"\x00\x01", {"shape": (1, 2), "ptx": "// ptx\n"})
        stored = self._cache().put(_key(0), entry)
        from_disk = self._cache().get(_key(0))
        self.assertEqual(stored, from_disk)
        self.assertEqual(from_disk.metadata, {"shape": [1, 2], "ptx": "// ptx\n"})

    def test_unserializable_metadata_raises(self):
        with self.assertRaisesRegex(TypeError, "JSON"):
            self._cache().put(_key(0), disk_cache.CacheEntry(b"x", {"f": object()}))

    @parameterized.named_parameters(
        ("short", "abc"), ("path", "../" + "0" * 61), ("upper", "A" * 64)
    )
    def test_bad_key_raises(self, key):
        with self.assertRaises(ValueError):
            self._cache().get(key)

    def test_threads_build_once(self):
        cache = self._cache()
        calls = []
        barrier = threading.Barrier(8)
        results = [None] * 8

        def build():
            calls.append(1)
            time.sleep(0.1)
            return _entry(0)

        def worker(i):
            barrier.wait()
            results[i] = cache.get_or_create(_key(0), build)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertLen(calls, 1)
        self.assertEqual(results, [_entry(0)] * 8)
        self.assertEqual(*self._stats(cache, misses=1, writes=1, memory_hits=7))

    # -- corruption ------------------------------------------------------------------------------

    @staticmethod
    def _flip(offset):
        def flip(data: bytes, path: Path) -> bytes:
            data = bytearray(data)
            data[offset] ^= 0x01
            return bytes(data)

        return flip

    @parameterized.named_parameters(
        ("empty", lambda data, path: b""),
        ("truncated_header", lambda data, path: data[: disk_cache.HEADER_SIZE - 1]),
        ("truncated_payload", lambda data, path: data[:-1]),
        ("extended", lambda data, path: data + b"\x00"),
        ("flip_magic", _flip(0)),
        ("flip_version", _flip(8)),
        ("flip_metadata_length", _flip(12)),
        ("flip_payload_length", _flip(16)),
        ("flip_key", _flip(24)),
        ("flip_digest", _flip(disk_cache.HEADER_SIZE - 1)),
        ("flip_metadata", _flip(disk_cache.HEADER_SIZE + 2)),
        ("flip_payload", _flip(-1)),
        ("garbage", lambda data, path: random.Random(0).randbytes(len(data))),
        ("wrong_key", lambda data, path: path.with_name(_key(1) + ".kernel").read_bytes()),
    )
    def test_corrupt_entry_is_a_miss_and_rebuilt(self, corrupt):
        key, entry = _key(0), _entry(0)
        writer = self._cache()
        writer.put(key, entry)
        writer.put(_key(1), _entry(1))
        path = writer.entry_path(key)
        path.write_bytes(corrupt(path.read_bytes(), path))
        self._check_detected_and_rebuilt(key, entry)

    def test_entry_of_another_format_version_is_a_miss(self):
        key, entry = _key(0), _entry(0)
        with mock.patch.object(disk_cache, "_FORMAT_VERSION", disk_cache._FORMAT_VERSION + 1):
            self._cache().put(key, entry)
            self.assertEqual(self._cache().get(key), entry)  # Valid for its own version.
        self._check_detected_and_rebuilt(key, entry)

    def _check_detected_and_rebuilt(self, key, entry):
        reader = self._cache()
        with self.assertLogs(disk_cache.logger, "WARNING") as logs:
            self.assertIsNone(reader.get(key))
        self.assertIn("corrupt entry", logs.output[0])
        self.assertFalse(reader.entry_path(key).exists())
        self.assertEqual(*self._stats(reader, misses=1, corrupt=1))
        build = mock.Mock(return_value=entry)
        self.assertEqual(reader.get_or_create(key, build), entry)
        build.assert_called_once()
        fresh = self._cache()
        self.assertEqual(fresh.get(key), entry)
        self.assertEqual(*self._stats(fresh, disk_hits=1))

    def test_corrupt_entry_replaced_meanwhile_is_not_deleted(self):
        key = _key(0)
        self._cache().put(key, _entry(0))
        decode = disk_cache._decode

        def replace_then_fail(k, data):
            # Another process rewrites the entry between this process's read and its delete.
            self._cache().put(key, _entry(0))
            raise disk_cache._CorruptEntry("simulated")

        reader = self._cache()
        with (
            mock.patch.object(disk_cache, "_decode", side_effect=replace_then_fail),
            self.assertLogs(disk_cache.logger, "WARNING"),
        ):
            self.assertIsNone(reader.get(key))
        self.assertEqual(decode(key, reader.entry_path(key).read_bytes()), _entry(0))

    # -- size bound ------------------------------------------------------------------------------

    def _entry_bytes(self, i) -> int:
        self._cache().put(_key(i), _entry(i))
        size = self._cache().entry_path(_key(i)).stat().st_size
        self._cache().clear()
        return size

    def test_evicts_least_recently_used(self):
        size = self._entry_bytes(0)
        cache = self._cache(max_bytes=3 * size + size // 2)
        past = time.time() - 1000
        for i in range(3):
            cache.put(_key(i), _entry(i))
            os.utime(cache.entry_path(_key(i)), (past + i, past + i))
        self.assertEqual(cache.stats().evictions, 0)
        # A disk hit in another process makes entry 0 the most recently used.
        self.assertIsNotNone(self._cache().get(_key(0)))
        cache.put(_key(3), _entry(3))
        on_disk = {i for i in range(4) if cache.entry_path(_key(i)).exists()}
        self.assertEqual(on_disk, {0, 2, 3})
        self.assertEqual(cache.stats().evictions, 1)
        self.assertIsNone(self._cache().get(_key(1)))
        self.assertEqual(cache.get(_key(1)), _entry(1))  # Still in this process's memory.

    def test_total_stays_within_bound(self):
        size = self._entry_bytes(0)
        cache = self._cache(max_bytes=5 * size)
        for i in range(20):
            cache.put(_key(i), _entry(i))
            total = sum(p.stat().st_size for p in self.dir.glob("*.kernel"))
            self.assertLessEqual(total, 5 * size)
        self.assertEqual(cache.stats().evictions, 15)

    def test_entry_larger_than_bound_stays_in_memory(self):
        cache = self._cache(max_bytes=100)
        with self.assertLogs(disk_cache.logger, "WARNING"):
            cache.put(_key(0), _entry(0))
        self.assertFalse(cache.entry_path(_key(0)).exists())
        self.assertEqual(cache.get(_key(0)), _entry(0))

    def test_stale_temporary_and_lock_files_are_swept(self):
        self.dir.mkdir(exist_ok=True)
        old = time.time() - 2 * disk_cache._STALE_S
        names = {
            "stale_tmp": ".tmp-dead.kernel",
            "fresh_tmp": ".tmp-alive.kernel",
            "stale_lock": _key(8) + ".lock",
            "fresh_lock": _key(9) + ".lock",
        }
        for label, name in names.items():
            (self.dir / name).write_bytes(b"")
            if label.startswith("stale"):
                os.utime(self.dir / name, (old, old))
        self._cache().put(_key(0), _entry(0))
        left = {p.name for p in self.dir.iterdir()}
        self.assertEqual(left, {names["fresh_tmp"], names["fresh_lock"], _key(0) + ".kernel"})

    def test_lock_of_another_user_still_locks(self):
        # Another user's 0644 lock file in a shared cache cannot be opened read-write; the
        # build still takes the lock (flock on a read-only descriptor), so another process
        # waits for it rather than building beside it.
        cache = self._cache()
        self.dir.mkdir(exist_ok=True)
        lock = self.dir / (_key(3) + ".lock")
        lock.write_bytes(b"")
        real_open = os.open

        def no_write(path, flags, *args):
            if str(path) == str(lock) and flags & os.O_RDWR:
                raise PermissionError(13, "Permission denied", str(path))
            return real_open(path, flags, *args)

        with mock.patch.object(disk_cache.os, "open", no_write):
            with cache._interprocess_lock(_key(3)):
                fd = real_open(lock, os.O_RDONLY)
                try:
                    with self.assertRaises(BlockingIOError):
                        disk_cache.fcntl.flock(
                            fd, disk_cache.fcntl.LOCK_EX | disk_cache.fcntl.LOCK_NB
                        )
                finally:
                    os.close(fd)

    # -- configuration ---------------------------------------------------------------------------

    def test_off_disables_disk(self):
        home = Path(self.enterContext(tempfile.TemporaryDirectory()))
        env = {"JAX_SM100_CACHE_DIR": "off", "HOME": str(home), "XDG_CACHE_HOME": str(home)}
        with mock.patch.dict(os.environ, env):
            for cache in (disk_cache.KernelCache(), disk_cache.KernelCache("off")):
                self.assertIsNone(cache.directory)
                self.assertIsNone(cache.entry_path(_key(0)))
                self.assertEqual(cache.get_or_create(_key(0), lambda: _entry(0)), _entry(0))
                self.assertEqual(cache.get(_key(0)), _entry(0))
                self.assertEqual(*self._stats(cache, misses=1, memory_hits=1))
                cache.clear()
                self.assertIsNone(cache.get(_key(0)))
        self.assertEqual(list(home.iterdir()), [])

    def test_default_folder_not_private_is_left_alone(self):
        # The default folder under a group-writable ~/.cache (umask 002): a warning naming the
        # fix and memory-only caching, where the same folder named by JAX_SM100_CACHE_DIR is
        # refused. Nothing was asked of the default, so a job does not stop on it.
        home = self.dir / "home"
        (home / ".cache" / "jax_sm100").mkdir(parents=True)
        os.chmod(home / ".cache", 0o775)
        env = {"HOME": str(home), "JAX_SM100_CACHE_DIR": "", "XDG_CACHE_HOME": ""}
        with mock.patch.dict(os.environ, env):
            cache = disk_cache.KernelCache()
            with self.assertLogs(disk_cache.logger, "WARNING") as logs:
                self.assertEqual(cache.get_or_create(_key(0), lambda: _entry(0)), _entry(0))
            self.assertIn("chmod go-w", "".join(logs.output))
            self.assertIsNone(cache.directory)
            # The folder a thread already past its checks holds stays a path (it became None
            # under other threads' lookups and writes: a TypeError there).
            self.assertIsNotNone(cache._dir)
            self.assertFalse(cache._write(_key(1), b"x"))
            with cache._interprocess_lock(_key(1)):
                pass
            self.assertEqual(cache.get(_key(0)), _entry(0))
            # A store before any lookup writes nothing there either.
            cache = disk_cache.KernelCache()
            with self.assertLogs(disk_cache.logger, "WARNING"):
                cache.put(_key(2), _entry(2))
            self.assertEqual(list((home / ".cache" / "jax_sm100").iterdir()), [])
            os.environ["JAX_SM100_CACHE_DIR"] = str(home / ".cache" / "jax_sm100")
            with self.assertRaisesRegex(disk_cache.UntrustedCacheError, "chmod go-w"):
                disk_cache.KernelCache().get(_key(0))

    def test_directory_from_environment(self):
        with mock.patch.dict(os.environ, {"JAX_SM100_CACHE_DIR": str(self.dir / "c")}):
            self.assertEqual(disk_cache.KernelCache().directory, self.dir / "c")
        with mock.patch.dict(os.environ, {"JAX_SM100_CACHE_DIR": "relative/c"}):
            self.assertEqual(disk_cache.KernelCache().directory, Path.cwd() / "relative" / "c")
        env = {"XDG_CACHE_HOME": str(self.dir / "xdg"), "HOME": str(self.dir / "home")}
        with mock.patch.dict(os.environ, env):
            os.environ.pop("JAX_SM100_CACHE_DIR", None)
            self.assertEqual(disk_cache.cache_dir_from_env(), self.dir / "xdg" / "jax_sm100")
            os.environ.pop("XDG_CACHE_HOME")
            self.assertEqual(
                disk_cache.cache_dir_from_env(), self.dir / "home" / ".cache" / "jax_sm100"
            )

    @parameterized.named_parameters(
        ("unset", None, disk_cache.DEFAULT_MAX_BYTES),
        ("set", "12345", 12345),
    )
    def test_max_bytes_from_environment(self, value, expected):
        with mock.patch.dict(os.environ):
            os.environ.pop("JAX_SM100_CACHE_MAX_BYTES", None)
            if value is not None:
                os.environ["JAX_SM100_CACHE_MAX_BYTES"] = value
            self.assertEqual(self._cache().max_bytes, expected)

    @parameterized.named_parameters(("zero", "0"), ("negative", "-5"), ("words", "2 GiB"))
    def test_bad_max_bytes_raises(self, value):
        with mock.patch.dict(os.environ, {"JAX_SM100_CACHE_MAX_BYTES": value}):
            with self.assertRaisesRegex(ValueError, "JAX_SM100_CACHE_MAX_BYTES"):
                self._cache()

    def test_unusable_directory_leaves_memory_cache_working(self):
        blocker = self.dir / "a_file"
        blocker.write_bytes(b"")
        cache = disk_cache.KernelCache(blocker / "cache")
        with self.assertLogs(disk_cache.logger, "WARNING") as logs:
            self.assertEqual(cache.get_or_create(_key(0), lambda: _entry(0)), _entry(0))
        self.assertIn("caching in memory only", logs.output[-1])
        self.assertIsNone(cache.directory)
        self.assertEqual(cache.get(_key(0)), _entry(0))
        with self.assertNoLogs(disk_cache.logger, "WARNING"):
            self.assertEqual(cache.get_or_create(_key(1), lambda: _entry(1)), _entry(1))
        self.assertEqual(cache.stats().writes, 0)

    def test_clear(self):
        cache = self._cache()
        cache.get_or_create(_key(0), lambda: _entry(0))
        cache.clear()
        self.assertEqual(list(self.dir.iterdir()), [])
        self.assertIsNone(cache.get(_key(0)))
        self.assertEqual(*self._stats(cache, misses=2, writes=1))

    def test_clear_memory_only(self):
        cache = self._cache()
        cache.put(_key(0), _entry(0))
        cache.clear(disk=False)
        self.assertEqual(cache.get(_key(0)), _entry(0))
        self.assertEqual(cache.stats().disk_hits, 1)


# Worker processes load disk_cache.py alone: it needs only the standard library, and importing
# the package would import jax (about a second per process).
_LOAD = f"""
import importlib.util, sys

def load_disk_cache():
    spec = importlib.util.spec_from_file_location(
        "disk_cache", {str(REPO_ROOT / "jax_sm100" / "_src" / "disk_cache.py")!r}
    )
    module = sys.modules["disk_cache"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
"""

# Run by each writer process: threads put and get shared and private keys; every entry read
# must be intact and match its metadata. Prints the cache's counters as JSON.
_WRITER = """
import hashlib, json, random, sys, threading
disk_cache = load_disk_cache()

directory, worker, max_bytes, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), 3
cache = disk_cache.KernelCache(directory, max_bytes=max_bytes)
shared = [hashlib.sha256(f"shared {i}".encode()).hexdigest() for i in range(4)]
errors = []

def entry(key, writer):
    rng = random.Random(f"{key} {writer}")
    payload = rng.randbytes(rng.randrange(1, 16 << 10))
    meta = {"writer": writer, "sha256": hashlib.sha256(payload).hexdigest()}
    return disk_cache.CacheEntry(payload, meta)

def check(key, got):
    if got is not None and got != entry(key, got.metadata["writer"]):
        errors.append(f"{key} from {got.metadata}")

readers = [disk_cache.KernelCache(directory, max_bytes=max_bytes) for _ in range(8)]

def run(thread):
    writer, reader = f"{worker}.{thread}", readers[thread]
    own = [hashlib.sha256(f"own {writer} {i}".encode()).hexdigest() for i in range(2)]
    for r in range(rounds):
        for key in shared + own:
            cache.put(key, entry(key, writer))
            for k in (key, shared[r % 4]):
                reader.clear(disk=False)  # Read from disk, as a new process would.
                check(k, reader.get(k))

threads = [threading.Thread(target=run, args=(t,)) for t in range(8)]
for t in threads: t.start()
for t in threads: t.join()
if errors:
    sys.exit("inconsistent entries: " + "; ".join(errors[:5]))
stats = disk_cache.dataclasses.asdict(cache.stats())
stats["reads"] = sum(r.stats().disk_hits for r in readers)
stats["corrupt"] += sum(r.stats().corrupt for r in readers)
print(json.dumps(stats))
"""

# Run by each builder process: waits for a common start time, then get_or_create of one key
# whose build appends a line to a log and takes a while.
_BUILDER = """
import sys, time
disk_cache = load_disk_cache()

directory, log, start = sys.argv[1], sys.argv[2], float(sys.argv[3])
def build():
    with open(log, "a") as f:
        f.write("built\\n")
    time.sleep(0.5)
    return disk_cache.CacheEntry(b"object", {"prefix": "k"})

time.sleep(max(0.0, start - time.time()))
entry = disk_cache.KernelCache(directory).get_or_create("ab" * 32, build)
assert entry == disk_cache.CacheEntry(b"object", {"prefix": "k"}), entry
"""


class ConcurrencyTest(parameterized.TestCase):
    def setUp(self):
        super().setUp()
        self.dir = Path(self.enterContext(tempfile.TemporaryDirectory()))

    def _spawn(self, script, *args):
        return subprocess.Popen(
            [sys.executable, "-c", _LOAD + script, *map(str, args)],
            env=tu.subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def _wait(self, procs):
        outs = []
        for p in procs:
            out, err = p.communicate(timeout=120)
            self.assertEqual(p.returncode, 0, msg=err)
            outs.append(out)
        return outs

    @parameterized.named_parameters(
        ("unbounded", 1 << 30),
        # About eight average entries: writers evict each other's entries as they write.
        ("evicting", 8 * (8 << 10)),
    )
    def test_processes_and_threads_never_tear_entries(self, max_bytes):
        procs = [self._spawn(_WRITER, self.dir, w, max_bytes) for w in range(8)]
        stats = [json.loads(out) for out in self._wait(procs)]
        self.assertEqual([s["corrupt"] for s in stats], [0] * 8)
        self.assertGreater(min(s["reads"] for s in stats), 8 * 3 * 6)
        self.assertEqual(sum(s["writes"] for s in stats), 8 * 8 * 3 * 6)

        names = sorted(p.name for p in self.dir.iterdir())
        self.assertEqual([n for n in names if not n.endswith(".kernel")], [])
        verifier = disk_cache.KernelCache(self.dir, max_bytes=max_bytes)
        for name in names:
            key = name.removesuffix(".kernel")
            entry = verifier.get(key)
            self.assertIsNotNone(entry, msg=name)
            self.assertEqual(
                hashlib.sha256(entry.payload).hexdigest(), entry.metadata["sha256"], msg=name
            )
        self.assertEqual(verifier.stats().corrupt, 0)
        total = sum(p.stat().st_size for p in self.dir.iterdir())
        self.assertLessEqual(total, max_bytes)
        if max_bytes == 1 << 30:
            self.assertLen(names, 4 + 8 * 8 * 2)

    @absltest.skipIf(disk_cache.fcntl is None, "needs fcntl for the cross-process build lock")
    def test_processes_build_once(self):
        log = self.dir / "builds.log"
        start = time.time() + 1.0
        procs = [self._spawn(_BUILDER, self.dir / "cache", log, start) for _ in range(4)]
        self._wait(procs)
        self.assertEqual(log.read_text(), "built\n")


if __name__ == "__main__":
    absltest.main()
