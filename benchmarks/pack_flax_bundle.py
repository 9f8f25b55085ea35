"""Packs what `examples/flax_finetune.py` imports beyond a bare JAX install into
`.devwheels/flaxpkgs.tar.xz`, for the GPU machine, which has JAX but no Flax, optax or network.

    .venv/bin/python benchmarks/pack_flax_bundle.py     # prints the bundle's size and the carry's

The example runs here at `--small` (CPU) under an import tracer that records each import
statement and `importlib.import_module` call with the module that made it. From the example, the
imports are followed through every module that a bare `pip install jax` lacks: not through the
standard library, nor jax and its declared requirements (jaxlib, numpy, scipy, ml_dtypes,
opt_einsum), whose own optional imports (etils, pygments, flatbuffers) are therefore left out. The
repository's modules are followed (`jax_sm100.flax` imports Flax) but not packed: they travel as
the working tree. The bundle is the source of each module reached, with its parent packages.

Only `.py` files travel (the machine's Python is 3.12; this one may differ), so the trace refuses
the extension modules of packages outside a bare JAX install: msgpack and PyYAML take their
pure-Python paths here, as they will there. To fit beside the DSL archive in a call's 64 MiB,
comments are dropped and docstrings blanked, with line numbers kept (tracebacks point right);
`help()` and `nnx.view_info` find no text in this bundle.

One line of Flax is rewritten: flax/nnx/variablelib.py's `from jax.experimental import hijax as
hjx` becomes `from flax.nnx import _bundle_hijax as hjx`, a module added to the bundle
(`HIJAX_SHIM`). JAX's hijax API is experimental and moves under Flax: no Flax release, nor Flax's
git main (its newest is of 2026-07-02), matches JAX main of 2026-08 (which dropped `AvalQDD`,
`AvalMutableQDD` and `MutableHiType`) or JAX 0.11.2, whose `jax.experimental.hijax` has no
`HiPrimitive` (`AttributeError` at flax/nnx/variablelib.py:326 on the GPU machine). Flax uses
these names only to define its hijax Variables, off unless `flax_hijax_variable` or
`nnx.var_defaults(hijax=True)` turns them on (the example does not). The module passes on each
name the running JAX has, so under a JAX that has them all nothing changes; for each it lacks it
gives a stand-in that lets the class definitions and registrations at import go through, and
fails, naming the absent name, when a hijax Variable is used. Older Flax releases are no way out:
flax 0.12.0 to 0.12.6 call `jax.core.get_opaque_trace_state` (gone in JAX 0.11.0) for every
nnx object.

On the GPU machine, from the repository root with `.devwheels` carried:

    mkdir -p /tmp/flaxpkgs && tar xJf .devwheels/flaxpkgs.tar.xz -C /tmp/flaxpkgs
    PYTHONPATH=/tmp/flaxpkgs:$PYTHONPATH python3 examples/flax_finetune.py
"""

from __future__ import annotations

import argparse
import ast
import builtins
import collections
import importlib
import importlib.machinery
import importlib.metadata
import importlib.util
import io
import json
import lzma
import os
import re
import runpy
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ["examples/flax_finetune.py", "--small"]
CARRY_LIMIT = 64 * 2**20  # bytes a device call carries: working tree and carried paths together
SITE_DIRS = sorted({Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")})


HIJAX_LINE = "from jax.experimental import hijax as hjx"
HIJAX_PATCHED = "from flax.nnx import _bundle_hijax as hjx"
HIJAX_SHIM = '''"""jax.experimental.hijax for this bundle's flax/nnx/variablelib.py
(benchmarks/pack_flax_bundle.py rewrote its import): JAX's own names where the running JAX has
them, else stand-ins. `ABSENT` lists the names this JAX lacks."""

import jax.experimental.hijax as _hijax

USED = {used!r}  # the hjx names flax/nnx/variablelib.py uses
ABSENT = sorted(n for n in USED if not hasattr(_hijax, n))


class _AbsentMeta(type):
    def __getattr__(cls, attr):  # e.g. control_flow_allowed_effects.add_type(...) at import
        if attr.startswith("__"):
            raise AttributeError(attr)
        return cls


class _Absent(metaclass=_AbsentMeta):
    """A name this JAX's hijax lacks: can be subclassed, called and decorated with at import;
    an instance's attributes raise."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, attr):
        raise NotImplementedError(
            "flax's hijax Variables need jax.experimental.hijax."
            f"{{type(self).__mro__[-3].__name__}}, which JAX {{__import__('jax').__version__}} "
            "lacks (this bundle's Flax is meant for it with hijax Variables off; absent: "
            f"{{', '.join(ABSENT)}})"
        )


def __getattr__(name):
    return getattr(_hijax, name)


for _n in USED:
    _stand_in = _AbsentMeta(_n, (_Absent,), {{}})
    globals()[_n] = getattr(_hijax, _n) if hasattr(_hijax, _n) else _stand_in
'''


def patch_hijax(rel: str, source: str) -> str:
    """flax/nnx/variablelib.py with its hijax import rewritten, line for line (module docstring)."""
    if rel != "flax/nnx/variablelib.py":
        return source
    if source.count(HIJAX_LINE + "\n") != 1:
        raise SystemExit(
            f"{rel}: expected one line `{HIJAX_LINE}`; the hijax shim needs revisiting"
        )
    return source.replace(HIJAX_LINE + "\n", HIJAX_PATCHED + "\n")


def canonical(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def bare_jax_modules() -> set[str]:
    """Top-level import names of jax and its declared requirements, transitively: what a bare
    `pip install jax` brings."""
    dists, todo = set(), ["jax"]
    while todo:
        dist = canonical(re.match(r"[A-Za-z0-9._-]+", todo.pop()).group())
        if dist not in dists:
            dists.add(dist)
            todo += [r for r in importlib.metadata.requires(dist) or [] if "extra ==" not in r]
    owners = importlib.metadata.packages_distributions()
    return {top for top, names in owners.items() if dists & {canonical(n) for n in names}}


def site_dir(path: str | Path) -> Path | None:
    """The site-packages directory `path` lies in, or None (standard library, the repository)."""
    path = Path(path).resolve()
    return next((d for d in SITE_DIRS if path.is_relative_to(d)), None)


class RefuseExtensions:
    """A meta path finder that refuses extension modules from site-packages outside a bare JAX
    install, so that packages with a pure-Python fallback take it, as they will on the machine."""

    def __init__(self, bare: set[str]):
        self.bare = bare

    def find_spec(self, name, path=None, target=None):
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if (
            spec is not None
            and isinstance(spec.loader, importlib.machinery.ExtensionFileLoader)
            and name.partition(".")[0] not in self.bare
            and site_dir(spec.origin) is not None
        ):
            raise ModuleNotFoundError(f"{name}: extension module refused by the trace", name=name)
        return None


def trace(out: str) -> None:
    """Runs the example, recording (importer, imported) module names, then writes them and each
    loaded module's file to `out` as JSON. Runs in a child process (`--trace`)."""
    sys.meta_path.insert(0, RefuseExtensions(bare_jax_modules()))
    edges = set()
    real_import, real_import_module = builtins.__import__, importlib.import_module

    def record(importer, name, fromlist):
        edges.add((importer, name))
        edges.update(
            (importer, f"{name}.{f}") for f in fromlist or () if f"{name}.{f}" in sys.modules
        )

    def traced_import(name, globals=None, locals=None, fromlist=(), level=0):
        module = real_import(name, globals, locals, fromlist, level)
        globals = globals or {}
        if level:
            name = importlib.util.resolve_name("." * level + name, globals.get("__package__"))
        record(globals.get("__name__"), name, fromlist)
        return module

    def traced_import_module(name, package=None):
        module = real_import_module(name, package)
        record(sys._getframe(1).f_globals.get("__name__"), module.__name__, ())
        return module

    builtins.__import__, importlib.import_module = traced_import, traced_import_module
    sys.argv = list(EXAMPLE)
    try:
        runpy.run_path(EXAMPLE[0], run_name="__main__")
    finally:
        builtins.__import__, importlib.import_module = real_import, real_import_module
        files = {n: getattr(m, "__file__", None) for n, m in list(sys.modules.items())}
        with open(out, "w") as f:
            json.dump({"edges": sorted(edges, key=repr), "files": files}, f)


def modules_to_pack(traced: dict) -> dict[str, Path]:
    """The modules reached from the example through modules outside a bare JAX install, with
    their parent packages, that lie in site-packages: name -> source file."""
    bare = bare_jax_modules()
    files = {n: Path(f) for n, f in traced["files"].items() if f}
    imports = collections.defaultdict(set)
    for importer, name in traced["edges"]:
        imports[importer].add(name)

    def followed(name):  # the example, the repository, and site-packages outside bare JAX
        if name == "__main__":
            return True
        if name not in files:
            return False
        if site_dir(files[name]) is None:
            return files[name].resolve().is_relative_to(ROOT)
        return name.partition(".")[0] not in bare

    reached, todo = set(), ["__main__"]
    while todo:
        name = todo.pop()
        if name in reached or not followed(name):
            continue
        reached.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        todo += imports[name]
    packed = {n: files[n] for n in reached if n != "__main__" and site_dir(files[n]) is not None}
    odd = sorted(str(f) for f in packed.values() if f.suffix != ".py")
    if odd:
        raise SystemExit(f"not a .py file, cannot travel: {odd}")
    return packed


def shrink(source: str) -> str:
    """`source` without comments and with each string statement (docstrings) blanked, line for
    line: the code and its line numbers are unchanged."""
    lines = source.splitlines(keepends=True)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            (row, col), line = tok.start, lines[tok.start[0] - 1]
            lines[row - 1] = line[:col].rstrip(" \t") + line[len(line.rstrip("\r\n")) :]
    strings = [
        n.value
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.Expr)
        and isinstance(n.value, ast.Constant)
        and isinstance(n.value.value, str)
    ]

    def column(row, byte_col):  # ast counts UTF-8 bytes, str slicing counts characters
        return len(lines[row - 1].encode()[:byte_col].decode())

    for s in sorted(strings, key=lambda s: (s.lineno, s.col_offset), reverse=True):
        first, last = s.lineno - 1, s.end_lineno - 1
        start, end = column(s.lineno, s.col_offset), column(s.end_lineno, s.end_col_offset)
        if first == last:
            lines[first] = lines[first][:start] + '""' + lines[first][end:]
        else:
            lines[first] = lines[first][:start] + '"""\n'
            lines[first + 1 : last] = ["\n"] * (last - first - 1)
            lines[last] = '"""' + lines[last][end:]
    out = "".join(lines)
    compile(out, "<shrunk>", "exec")
    return out


def carry_bytes(devwheels: Path) -> int:
    """Bytes a call carries with `.devwheels`: the working tree as git sees it (tracked and
    untracked, not ignored) and everything under `.devwheels`."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout.split("\0")  # fmt: skip
    tree = sum((ROOT / p).stat().st_size for p in listed if p and (ROOT / p).is_file())
    return tree + sum(f.stat().st_size for f in devwheels.rglob("*") if f.is_file())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / ".devwheels" / "flaxpkgs.tar.xz")
    parser.add_argument("--trace", help=argparse.SUPPRESS)  # the child process's mode
    args = parser.parse_args()
    if args.trace:
        return trace(args.trace)

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "trace.json")
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        child = [sys.executable, __file__, "--trace", out]
        run = subprocess.run(child, cwd=ROOT, env=env, capture_output=True, text=True)
        if run.returncode:
            raise SystemExit(f"{' '.join(EXAMPLE)} failed under the trace:\n{run.stderr[-4000:]}")
        with open(out) as f:
            packed = modules_to_pack(json.load(f))

    args.out.parent.mkdir(parents=True, exist_ok=True)
    raw = small = 0
    with tarfile.open(args.out, "w:xz", preset=9 | lzma.PRESET_EXTREME) as tar:
        for path in sorted({f.resolve() for f in packed.values()}):
            source = path.read_text(encoding="utf-8")
            rel = str(path.relative_to(site_dir(path)))
            data = shrink(patch_hijax(rel, source)).encode()
            raw, small = raw + len(source.encode()), small + len(data)
            files = [(rel, data)]
            if rel == "flax/nnx/variablelib.py":
                used = sorted(set(re.findall(r"\bhjx\.(\w+)", source)))
                shim = HIJAX_SHIM.format(used=tuple(used)).encode()
                files.append(("flax/nnx/_bundle_hijax.py", shim))
                raw, small = raw + len(shim), small + len(shim)
            for name, content in files:
                info = tarfile.TarInfo(name)
                info.size, info.mode = len(content), 0o644
                tar.addfile(info, io.BytesIO(content))
    per_package = collections.Counter(n.partition(".")[0] for n in packed)
    print("packed modules:", ", ".join(f"{p} {n}" for p, n in sorted(per_package.items())))
    size = args.out.stat().st_size
    print(f"{len(packed)} files, {raw:,} bytes of source, {small:,} without comments and "
          f"docstrings; {args.out.relative_to(ROOT)}: {size:,} bytes")  # fmt: skip
    if args.out.parent == ROOT / ".devwheels":
        total = carry_bytes(args.out.parent)
        print(f"a call carrying .devwheels: {total:,} bytes (working tree + .devwheels) of "
              f"{CARRY_LIMIT:,}; margin {CARRY_LIMIT - total:,}")  # fmt: skip


if __name__ == "__main__":
    main()
