"""Wall time of CLI calls a user makes first: ``--help``, an argument error, ``plan`` of a small model.

    python benchmarks/cli_startup.py --out out/cli_startup.json

Each command runs ``--repeat`` times in a fresh process (``python -m afd_compile.cli``); the table
gives the median and the slowest, in seconds, and whether the process imported torch (``--help``
and argument errors must not: issue 17). ``plan`` runs on a 2-layer HF Llama exported here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CLI = [sys.executable, "-m", "afd_compile.cli"]
PROBE = ("import sys, runpy; sys.argv = ['afd-compile'] + sys.argv[1:]\n"
         "try:\n    runpy.run_module('afd_compile.cli', run_name='__main__')\n"
         "except SystemExit:\n    pass\n"
         "print('torch imported:', 'torch' in sys.modules, file=sys.stderr)")


def _time(argv: list[str], repeat: int) -> tuple[float, float, bool]:
    times, imported = [], False
    for _ in range(repeat):
        t0 = time.perf_counter()
        res = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True)
        times.append(time.perf_counter() - t0)
        imported = "torch imported: True" in res.stderr
    return statistics.median(times), max(times), imported


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default="out/cli_startup.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        model = os.path.join(d, "llama.pt2")
        subprocess.run([sys.executable, "-c", "import torch; from afd_compile.models import build_hf, export_lm; "
                        f"torch.export.save(export_lm(build_hf('llama')), {model!r})"], check=True)
        cases = {"afd-compile --help": ["--help"],
                 "afd-compile verify x.pt2 -A 1 (argument error)": ["verify", "x.pt2", "-A", "1"],
                 "afd-compile plan MODEL.pt2 -A 2 -F 1 -q": ["plan", model, "-A", "2", "-F", "1", "-q"]}
        rows = [(name, *_time(argv, args.repeat)) for name, argv in cases.items()]
    print(f"CLI wall time, {args.repeat} fresh processes each, python {sys.version.split()[0]}")
    print("| command | median s | slowest s | imports torch |")
    print("|---|---|---|---|")
    for name, med, worst, imported in rows:
        print(f"| `{name}` | {med:.2f} | {worst:.2f} | {'yes' if imported else 'no'} |")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump([{"command": n, "median_s": m, "max_s": w, "imports_torch": i} for n, m, w, i in rows], f, indent=1)


if __name__ == "__main__":
    main()
