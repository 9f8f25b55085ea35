"""Tests of the compiled-kernel cache key: every plan/spec field, the environment, the sources."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import importlib.metadata
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from unittest import mock

from absl.testing import absltest, parameterized

from jax_sm100._src import kernel_key, planning
from jax_sm100._src.kernels.spec import KernelSpec
from tests import test_util as tu


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
    )
    def test_bad_arguments_raise(self, kwargs):
        with self.assertRaises(TypeError):
            kernel_key.cache_key(self.plan, self.spec, **kwargs)

    def test_same_key_in_other_processes(self):
        script = textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {str(Path(__file__).parent)!r})
            import test_kernel_key as t
            from jax_sm100._src import kernel_key
            print(kernel_key.cache_key(t.sample_plan(), t.sample_spec(), arch="sm_100a"))
            """
        )
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", script],
                env=tu.subprocess_env(PYTHONHASHSEED=seed),
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
        (root / "planning").mkdir()
        (root / "planning" / "sm100.py").write_text("PLAN = 4\n")
        (root / "api.py").write_text("API = 4\n")
        (root / "constraints.py").write_text("PAD = 5\n")
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
        # The kernels run the planner's code while traced (grid clusters, TMEM columns).
        ("planning_edit", lambda r: (r / "planning/sm100.py").write_text("PLAN = 5\n"), True),
        ("api_edit", lambda r: (r / "api.py").write_text("API = 5\n"), False),
        # The kernels read the constraints' sizes (alignments, limits) as they are traced.
        ("constraints_edit", lambda r: (r / "constraints.py").write_text("PAD = 6\n"), True),
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

    def test_sources_without_python_files(self):
        # A .pyc-only install hashes the compiled files (an edit still changes the key); with
        # nothing to read, each process keys its binaries apart from every other's.
        root = self._tree()
        for path in list(root.rglob("*.py")):
            path.with_suffix(".pyc").write_bytes(path.read_bytes() + b"c")
            path.unlink()
        before = kernel_key._hash_sources(root)
        self.assertRegex(before, r"^[0-9a-f]{64}$")
        (root / "kernels/sm100_gemm.pyc").write_bytes(b"edited")
        edited = kernel_key._hash_sources(root)
        self.assertNotEqual(edited, before)
        (root / "compile.pyc").write_bytes(b"edited")
        self.assertNotEqual(kernel_key._hash_sources(root), edited)
        empty = Path(self.enterContext(tempfile.TemporaryDirectory()))
        with self.assertLogs("jax_sm100._src.disk_cache", "WARNING"):
            first = kernel_key._hash_sources(empty)
        with self.assertLogs("jax_sm100._src.disk_cache", "WARNING"):
            self.assertNotEqual(kernel_key._hash_sources(empty), first)

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

    def test_dsl_compile_settings_change_the_key(self):
        # The DSL's own compile settings (CUTE_DSL_LINEINFO and the like) make other binaries:
        # each its own key. Its target arch (the kernel's `arch`) and the path of its runtime
        # library (this machine's) do not count.
        from cutlass.cutlass_dsl.cutlass import CuTeDSL  # noqa: PLC0415

        plan = planning.plan(256, 256, 256, a_dtype="bfloat16", b_dtype="bfloat16",
                             arch="sm_100a", force_kernel=True)  # fmt: skip
        spec = KernelSpec.for_plan(plan)
        before = kernel_key.cache_key(plan, spec, arch="sm_100a")
        envar = CuTeDSL._get_dsl().envar
        self.assertIn("lineinfo=", kernel_key.dsl_compile_settings())
        for name, value in (("lineinfo", True), ("debug", True), ("compiler_opt", "opt-level=1")):
            saved = getattr(envar, name)
            setattr(envar, name, value)
            try:
                self.assertNotEqual(kernel_key.cache_key(plan, spec, arch="sm_100a"), before, name)
            finally:
                setattr(envar, name, saved)
        self.assertEqual(kernel_key.cache_key(plan, spec, arch="sm_100a"), before)
        saved = envar._arch
        envar.arch = "sm_90a"
        try:
            self.assertEqual(kernel_key.cache_key(plan, spec, arch="sm_100a"), before)
        finally:
            envar._arch = saved
        self.assertNotIn("shared_libs", kernel_key.dsl_compile_settings())

    def test_dsl_compile_settings_without_the_dsl(self):
        env = {"CUTE_DSL_LINEINFO": "1", "CUTE_DSL_ARCH": "sm_90a", "OTHER": "x"}
        with (
            mock.patch.dict(sys.modules, {"cutlass.cutlass_dsl.cutlass": None}),
            mock.patch.dict(kernel_key.os.environ, env, clear=True),
        ):
            self.assertEqual(kernel_key.dsl_compile_settings(), "CUTE_DSL_LINEINFO=1")


if __name__ == "__main__":
    absltest.main()
