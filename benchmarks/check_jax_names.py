"""Static check: every jax name that the .py files under a folder import or reach by attribute
(`from jax.x import y`, `import jax.x`, `jax.x.y` chains from a name bound to a jax module,
function bodies included) exists in the JAX source at a git ref, for a JAX that cannot be
installed here. E.g. for the Flax bundle (benchmarks/pack_flax_bundle.py) against a JAX clone:

    mkdir -p /tmp/flaxpkgs && tar xJf .devwheels/flaxpkgs.tar.xz -C /tmp/flaxpkgs
    python3.12 benchmarks/check_jax_names.py /tmp/flaxpkgs <jax.git> main jax-v0.11.0

Reads JAX's source with Python's own parser: use a Python that parses it (3.12 for JAX 0.11).
Names are resolved through module-level definitions and imports (star imports too) and
`_deprecations` tables (an entry whose object is None counts as missing); an attribute of an
object (not a module) is not followed. A hit may be in a branch that is not taken (a version
guard, a fallback): read each.
"""

import ast
import functools
import subprocess
import sys
from pathlib import Path

GIT = None


def git(*args):
    return subprocess.run(
        ["git", "--git-dir", GIT, *args], check=True, capture_output=True, text=True
    ).stdout


class Jax:
    def __init__(self, ref):
        self.ref = ref
        self.files = set(git("ls-tree", "-r", "--name-only", ref, "jax/").split())

    def module_path(self, mod):
        p = mod.replace(".", "/")
        for c in (p + ".py", p + "/__init__.py"):
            if c in self.files:
                return c
        return None

    def is_module(self, mod):
        return self.module_path(mod) is not None

    @functools.cache  # noqa: B019 (one Jax per ref, alive for the run)
    def exports(self, mod):
        """name -> ('module', target) | ('object', None) | ('removed', None) | ('deprecated', x)."""
        path = self.module_path(mod)
        out = {}
        if path is None:
            return out
        tree = ast.parse(git("show", f"{self.ref}:{path}"))
        pkg = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]

        def absolute(node):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - node.level + 1]
                return ".".join(base + ([node.module] if node.module else []))
            return node.module

        def body_nodes(body):  # top level, through if/try/with, not into defs
            for n in body:
                yield n
                for field in ("body", "orelse", "finalbody", "handlers"):
                    sub = getattr(n, field, None)
                    if isinstance(sub, list) and not isinstance(
                        n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
                    ):
                        yield from body_nodes(sub)

        for n in body_nodes(tree.body):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.setdefault(n.name, ("object", None))
            elif isinstance(n, ast.Assign):
                for t in n.targets:
                    for e in ast.walk(t):
                        if isinstance(e, ast.Name):
                            out.setdefault(e.id, ("object", None))
                if (
                    len(n.targets) == 1
                    and isinstance(n.targets[0], ast.Name)
                    and n.targets[0].id == "_deprecations"
                    and isinstance(n.value, ast.Dict)
                ):
                    for k, v in zip(n.value.keys, n.value.values, strict=True):
                        if isinstance(k, ast.Constant) and isinstance(v, ast.Tuple):
                            gone = isinstance(v.elts[-1], ast.Constant) and v.elts[-1].value is None
                            out[k.value] = ("removed", None) if gone else ("deprecated", None)
            elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                out.setdefault(n.target.id, ("object", None))
            elif isinstance(n, ast.Import):
                for a in n.names:
                    if a.asname:
                        out[a.asname] = ("module", a.name)
                    else:
                        out.setdefault(
                            a.name.partition(".")[0], ("module", a.name.partition(".")[0])
                        )
            elif isinstance(n, ast.ImportFrom):
                src = absolute(n)
                for a in n.names:
                    if a.name == "*":
                        if src and src.startswith("jax"):
                            for k, v in self.exports(src).items():
                                if not k.startswith("_"):
                                    out.setdefault(k, v)
                        continue
                    name = a.asname or a.name
                    if src and self.is_module(f"{src}.{a.name}"):
                        out[name] = ("module", f"{src}.{a.name}")
                    elif src and src.startswith("jax"):
                        out[name] = self.exports(src).get(a.name, ("object", None))
                    else:
                        out[name] = ("object", None)
        return out

    def lookup(self, mod, name):
        """('module', m) | ('object'|'deprecated', None) | None if missing."""
        if self.is_module(f"{mod}.{name}"):
            return ("module", f"{mod}.{name}")
        e = self.exports(mod).get(name)
        if e is None or e[0] == "removed":
            return None
        return e


def uses(path):
    """(lineno, description, module, [attrs]) for each jax reference in a file."""
    tree = ast.parse(path.read_text())
    bound, refs = {}, []
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                if a.name.split(".")[0] == "jax":
                    refs.append((n.lineno, f"import {a.name}", "jax", a.name.split(".")[1:]))
                    if a.asname:
                        bound[a.asname] = a.name.split(".")
                    else:
                        bound["jax"] = ["jax"]
        elif (
            isinstance(n, ast.ImportFrom)
            and not n.level
            and n.module
            and n.module.split(".")[0] == "jax"
        ):
            for a in n.names:
                parts = n.module.split(".") + [a.name]
                refs.append((n.lineno, f"from {n.module} import {a.name}", "jax", parts[1:]))
                bound[a.asname or a.name] = parts
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and not isinstance(
            getattr(n, "_parent", None), ast.Attribute
        ):
            chain, e = [], n
            while isinstance(e, ast.Attribute):
                chain.append(e.attr)
                e = e.value
            if isinstance(e, ast.Name) and e.id in bound:
                parts = bound[e.id] + chain[::-1]
                refs.append((n.lineno, ".".join([e.id] + chain[::-1]), "jax", parts[1:]))
        for c in ast.iter_child_nodes(n):
            c._parent = n
    return refs


def check(jax, root):
    missing, deprecated, seen = [], [], 0
    for path in sorted(Path(root).rglob("*.py")):
        for lineno, desc, mod, attrs in uses(path):
            seen += 1
            where = f"{path.relative_to(root)}:{lineno}: {desc}"
            for a in attrs:
                r = jax.lookup(mod, a)
                if r is None:
                    missing.append(f"{where}  ({mod}.{a} missing)")
                    break
                if r[0] == "deprecated":
                    deprecated.append(f"{where}  ({mod}.{a} deprecated)")
                if r[0] != "module":
                    break  # an object: further attributes are the object's
                mod = r[1]
    return seen, missing, deprecated


if __name__ == "__main__":
    root, GIT, refs = sys.argv[1], sys.argv[2], sys.argv[3:]
    for ref in refs:
        seen, missing, deprecated = check(Jax(ref), root)
        print(
            f"== {ref}: {seen} jax references, {len(missing)} missing, {len(deprecated)} deprecated"
        )
        for m in sorted(set(missing)):
            print("  MISSING", m)
        for d in sorted(set(deprecated)):
            print("  deprecated", d)
