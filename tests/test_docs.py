"""The documentation's scripts, run as written."""

from __future__ import annotations

import os
import re

from scriptrun import run_script

DOCS = os.path.join(os.path.dirname(__file__), "..", "docs")


def _block(path: str, name: str) -> str:
    """The fenced code between ``<!-- NAME-begin -->`` and ``<!-- NAME-end -->`` in ``path``."""
    text = open(path).read()
    m = re.search(rf"<!-- {name}-begin -->\n```python\n(.*?)```\n<!-- {name}-end -->", text, flags=re.S)
    assert m, f"{path} has no {name} block"
    return m.group(1)


def test_the_backend_docs_forward_pass_runs_as_written(tmp_path):
    # docs/backend.md's script: a tiny HF Llama under attention=2, ffn=1 through afd_compile.compile,
    # each attention rank its own batch, compared with the uncompiled model on three gloo ranks
    script = tmp_path / "afd_forward.py"
    script.write_text(_block(os.path.join(DOCS, "backend.md"), "afd-forward"))
    assert len(script.read_text().splitlines()) <= 25
    proc = run_script(3, str(script))
    assert proc.returncode == 0, proc.stdout[-3000:]
    errs = {int(r): float(e) for r, e in re.findall(r"^rank (\d+): max_rel_err=(\S+)$", proc.stdout, flags=re.M)}
    assert sorted(errs) == [1, 2] and max(errs.values()) <= 1e-5, proc.stdout
