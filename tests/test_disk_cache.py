"""Tests of the compiled-kernel cache: keys, hits and misses, corruption, concurrency, bounds."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import importlib.metadata
import json
import os
import random
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from unittest import mock

from absl.testing import absltest, parameterized

from jax_sm100._src import disk_cache, kernel_key, planning
from jax_sm100._src.kernels.spec import KernelSpec

REPO_ROOT = Path(__file__).resolve().parents[1]


def sample_plan() -> planning.GemmPlan:
    return planning.plan(4096, 2048, 1024, a_dtype="bfloat16", b_dtype="bfloat16", batch=2)


def sample_spec() -> KernelSpec:
    return KernelSpec(
        "bfloat16", "bfloat16", "bfloat16", c_dtype="bfloat16", bias_dtype="float32",
        activation="gelu", alpha=0.5,
    )  # fmt: skip


def _perturbed(value):
    """A value of the same kind that differs from `value`."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value + 0.5
    if isinstance(value, str):
        return value + "_x"
    if value is None:
        return "x"
    if isinstance(value, tuple):
        return (_perturbed(value[0]),) + value[1:] if value else (0,)
    raise TypeError(f"no perturbation for {value!r}")


def _with_field(obj, name, value):
    """A copy of a frozen dataclass with one field replaced, skipping its validation.

    The key must change whatever the field holds; whether the planner would produce that
    value is beside the point.
    """
    new = copy.copy(obj)
    object.__setattr__(new, name, value)
    return new


def _subprocess_env(**overrides) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
    env.update(overrides)
    return env


def _key(i) -> str:
    return hashlib.sha256(f"key {i}".encode()).hexdigest()


def _entry(i, size: int = 1000) -> disk_cache.CacheEntry:
    payload = random.Random(str(i)).randbytes(size)
    return disk_cache.CacheEntry(payload, {"prefix": f"kernel_{i:>4}", "args": ["a", "b", "d"]})


class CacheKeyTest(parameterized.TestCase):
    def setUp(self):
        super().setUp()
        self.plan = sample_plan()
        self.spec = sample_spec()
        self.key = kernel_key.cache_key(self.plan, self.spec, arch="sm_100a")

    def test_key_is_sha256_hex_and_stable(self):
        self.assertRegex(self.key, r"^[0-9a-f]{64}$")
        again = kernel_key.cache_key(sample_plan(), sample_spec(), arch="sm_100a")
        self.assertEqual(again, self.key)

    @parameterized.named_parameters((f.name, f.name) for f in dataclasses.fields(planning.GemmPlan))
    def test_each_plan_field_changes_key(self, name):
        plan = _with_field(self.plan, name, _perturbed(getattr(self.plan, name)))
        self.assertNotEqual(kernel_key.cache_key(plan, self.spec, arch="sm_100a"), self.key)

    @parameterized.named_parameters((f.name, f.name) for f in dataclasses.fields(KernelSpec))
    def test_each_spec_field_changes_key(self, name):
        spec = _with_field(self.spec, name, _perturbed(getattr(self.spec, name)))
        self.assertNotEqual(kernel_key.cache_key(self.plan, spec, arch="sm_100a"), self.key)

    def test_arch_changes_key(self):
        self.assertNotEqual(kernel_key.cache_key(self.plan, self.spec, arch="sm_90a"), self.key)

    @parameterized.named_parameters(
        ("dsl_version", "dsl_version", "4.9.0"),
        ("dsl_build", "dsl_build_fingerprint", "_cutlass_ir_version_cu13.py=00"),
        ("sources", "kernel_sources_hash", "0" * 64),
    )
    def test_environment_changes_key(self, function, value):
        with mock.patch.object(kernel_key, function, return_value=value):
            key = kernel_key.cache_key(self.plan, self.spec, arch="sm_100a")
        self.assertNotEqual(key, self.key)

    def test_host_cpu_changes_key(self):
        with mock.patch.object(kernel_key.platform, "machine", return_value="aarch64-test"):
            key = kernel_key.cache_key(self.plan, self.spec, arch="sm_100a")
        self.assertNotEqual(key, self.key)

    def test_extra_changes_key_and_its_order_does_not(self):
        a = kernel_key.cache_key(self.plan, self.spec, arch="sm_100a", extra={"x": "1", "y": "2"})
        b = kernel_key.cache_key(self.plan, self.spec, arch="sm_100a", extra={"y": "2", "x": "1"})
        c = kernel_key.cache_key(self.plan, self.spec, arch="sm_100a", extra={"x": "1", "y": "3"})
        self.assertEqual(a, b)
        self.assertNotEqual(a, self.key)
        self.assertNotEqual(a, c)

    def test_values_that_compare_equal_but_differ_in_type_give_different_keys(self):
        keys = {
            kernel_key.cache_key(_with_field(self.plan, "num_sms", v), self.spec, arch="sm_100a")
            for v in (1, 1.0, True, "1", (1,), [1])
        }
        self.assertLen(keys, 6)

    def test_ignored_plan_fields_share_a_key(self):
        sizes = ("m", "n", "k", "batch", "reason")
        key = kernel_key.cache_key(self.plan, self.spec, arch="sm_100a", ignore_plan_fields=sizes)
        self.assertNotEqual(key, self.key)
        for name in sizes:
            plan = _with_field(self.plan, name, _perturbed(getattr(self.plan, name)))
            other = kernel_key.cache_key(plan, self.spec, arch="sm_100a", ignore_plan_fields=sizes)
            self.assertEqual(other, key, msg=name)
        plan = _with_field(self.plan, "num_ab_stages", self.plan.num_ab_stages + 1)
        other = kernel_key.cache_key(plan, self.spec, arch="sm_100a", ignore_plan_fields=sizes)
        self.assertNotEqual(other, key)

    def test_ignoring_an_unknown_field_raises(self):
        with self.assertRaisesRegex(ValueError, "not fields of GemmPlan"):
            kernel_key.cache_key(self.plan, self.spec, arch="sm_100a", ignore_plan_fields=["mm"])

    def test_plan_and_spec_are_not_interchangeable(self):
        swapped = kernel_key.cache_key(self.spec, self.plan, arch="sm_100a")
        self.assertNotEqual(swapped, self.key)

    @parameterized.named_parameters(
        ("object", object()),
        ("function", len),
    )
    def test_unserializable_field_raises(self, value):
        with self.assertRaisesRegex(TypeError, "cannot serialize"):
            kernel_key.cache_key(_with_field(self.plan, "reason", value), self.spec, arch="sm_100a")

    @parameterized.named_parameters(
        ("arch_none", dict(arch=None)),
        ("arch_empty", dict(arch="")),
        ("extra_int", dict(arch="sm_100a", extra={"x": 1})),
    )
    def test_bad_arguments_raise(self, kwargs):
        with self.assertRaises(TypeError):
            kernel_key.cache_key(self.plan, self.spec, **kwargs)

    def test_same_key_in_other_processes(self):
        script = textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {str(Path(__file__).parent)!r})
            import test_disk_cache as t
            from jax_sm100._src import kernel_key
            print(kernel_key.cache_key(t.sample_plan(), t.sample_spec(), arch="sm_100a"))
            """
        )
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", script],
                env=_subprocess_env(PYTHONHASHSEED=seed),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for seed in ("1", "2")
        ]
        for p in procs:
            out, err = p.communicate(timeout=120)
            self.assertEqual(p.returncode, 0, msg=err)
            self.assertEqual(out.strip(), self.key, msg=err)


class EnvironmentFingerprintTest(parameterized.TestCase):
    def _tree(self) -> Path:
        root = Path(self.enterContext(tempfile.TemporaryDirectory()))
        (root / "kernels" / "sub").mkdir(parents=True)
        (root / "kernels" / "sm100_gemm.py").write_text("KERNEL = 1\n")
        (root / "kernels" / "sub" / "epilogue.py").write_text("EPI = 2\n")
        (root / "compile.py").write_text("COMPILE = 3\n")
        (root / "planning.py").write_text("PLAN = 4\n")
        return root

    def test_real_sources_hash(self):
        self.assertRegex(kernel_key.kernel_sources_hash(), r"^[0-9a-f]{64}$")
        self.assertEqual(
            kernel_key.kernel_sources_hash(), kernel_key._hash_sources(kernel_key._SRC_ROOT)
        )

    @parameterized.named_parameters(
        ("kernel_edit", lambda r: (r / "kernels/sm100_gemm.py").write_text("KERNEL = 2\n"), True),
        ("nested_edit", lambda r: (r / "kernels/sub/epilogue.py").write_text("EPI = 3\n"), True),
        ("compile_edit", lambda r: (r / "compile.py").write_text("COMPILE = 4\n"), True),
        ("compile_removed", lambda r: (r / "compile.py").unlink(), True),
        ("kernel_added", lambda r: (r / "kernels/sm90_gemm.py").write_text(""), True),
        (
            "kernel_renamed",
            lambda r: (r / "kernels/sm100_gemm.py").rename(r / "kernels/sm100_gemm2.py"),
            True,
        ),
        ("planning_edit", lambda r: (r / "planning.py").write_text("PLAN = 5\n"), False),
        # The modules that name and store a binary do not change it.
        ("key_module_added", lambda r: (r / "kernel_key.py").write_text("KEY = 1\n"), False),
        ("cache_module_added", lambda r: (r / "disk_cache.py").write_text("CACHE = 1\n"), False),
        ("non_python_added", lambda r: (r / "kernels/notes.txt").write_text("x"), False),
    )
    def test_sources_hash_sensitivity(self, edit, changes):
        root = self._tree()
        before = kernel_key._hash_sources(root)
        edit(root)
        after = kernel_key._hash_sources(root)
        if changes:
            self.assertNotEqual(before, after)
        else:
            self.assertEqual(before, after)

    def test_dsl_version_from_metadata(self):
        self.assertEqual(
            kernel_key.dsl_version.__wrapped__(),
            importlib.metadata.version(kernel_key.DSL_DISTRIBUTION),
        )

    def test_dsl_version_without_metadata_reads_the_source(self):
        with mock.patch.object(
            importlib.metadata, "version", side_effect=importlib.metadata.PackageNotFoundError
        ):
            version = kernel_key.dsl_version.__wrapped__()
        self.assertEqual(version, importlib.metadata.version(kernel_key.DSL_DISTRIBUTION))

    def test_dsl_absent(self):
        with (
            mock.patch.object(
                importlib.metadata, "version", side_effect=importlib.metadata.PackageNotFoundError
            ),
            mock.patch.object(kernel_key.importlib.util, "find_spec", return_value=None),
            mock.patch.object(kernel_key, "_loaded_compiler_library", return_value=None),
        ):
            self.assertEqual(kernel_key.dsl_version.__wrapped__(), "absent")
            self.assertEqual(kernel_key.dsl_build_fingerprint.__wrapped__(), "")

    def test_dsl_build_fingerprint_is_the_loaded_flavour(self):
        library = kernel_key._loaded_compiler_library()
        flavour = library.name.split(".")[1]
        self.assertRegex(flavour, r"^cu\d+$")
        digest = hashlib.sha256(
            library.with_name(f"_cutlass_ir_version_{flavour}.py").read_bytes()
        ).hexdigest()
        self.assertEqual(kernel_key.dsl_build_fingerprint(), f"{flavour}={digest}")

    def test_dsl_build_fingerprint_unloaded_lists_every_flavour(self):
        with mock.patch.object(kernel_key, "_loaded_compiler_library", return_value=None):
            fingerprint = kernel_key.dsl_build_fingerprint.__wrapped__()
        self.assertRegex(fingerprint, r"^_cutlass_ir_version_cu\d+\.py=[0-9a-f]{64}")

    def test_other_flavour_gives_another_fingerprint(self):
        tmp_flavour = "cu99"
        library = kernel_key._loaded_compiler_library()
        root = Path(self.enterContext(tempfile.TemporaryDirectory()))
        other = root / library.name.replace(library.name.split(".")[1], tmp_flavour)
        other.write_bytes(b"")
        (root / f"_cutlass_ir_version_{tmp_flavour}.py").write_text('DSO_SHA256 = {"x": "0"}\n')
        with mock.patch.object(kernel_key, "_loaded_compiler_library", return_value=other):
            fingerprint = kernel_key.dsl_build_fingerprint.__wrapped__()
        self.assertStartsWith(fingerprint, f"{tmp_flavour}=")
        self.assertNotEqual(fingerprint, kernel_key.dsl_build_fingerprint())


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
            env=_subprocess_env(),
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
