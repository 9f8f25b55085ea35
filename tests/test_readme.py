"""The README's Python code blocks run as written, in order, as a new user pastes them.

They run in one fresh interpreter (the default JAX configuration, not this test process's),
each block compiled under its README line number so that a failure names the block.
"""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys
import textwrap

from absl.testing import absltest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"

_RUNNER = textwrap.dedent(
    """
    import json, sys
    blocks = json.load(sys.stdin)
    namespace = {"__name__": "__main__"}
    for line, source in blocks:
        print(f"--- README.md line {line}", flush=True)
        exec(compile(source, f"README.md, block at line {line}", "exec"), namespace)
    """
)


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line of the opening fence, source) of every ```python block."""
    blocks = []
    for match in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M):
        blocks.append((text.count("\n", 0, match.start()) + 1, match.group(1)))
    return blocks


class ReadmeTest(absltest.TestCase):
    def test_code_blocks_run(self):
        blocks = python_blocks(README.read_text())
        self.assertGreaterEqual(len(blocks), 6)
        proc = subprocess.run(
            [sys.executable, "-c", _RUNNER],
            input=json.dumps(blocks),
            capture_output=True,
            text=True,
            timeout=900,
            cwd=README.parent,
        )
        self.assertEqual(proc.returncode, 0, proc.stdout[-4000:] + proc.stderr[-8000:])
        self.assertEqual(proc.stdout.count("--- README.md line"), len(blocks))


if __name__ == "__main__":
    absltest.main()
