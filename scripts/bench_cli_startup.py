"""Benchmark: how long the ``ckptq`` command takes for what needs no checkpoint and no torch.

One command: ``python scripts/bench_cli_startup.py [--repeat 15] [--json OUT] [--root DIR]``
(``--root``: another ckptq checkout to time, e.g. an older commit's, run as ``python -m ckptq``).

Each case is a fresh process, run ``--repeat`` times after one warm-up run (which fills the OS file
cache); reported: the median and minimum wall time and the median CPU time (user + system), in the same
run as the baseline ``python -c pass`` (the interpreter's own start), and whether the case imported
torch (``python -X importtime``). The cases: ``ckptq --help``, ``ckptq --version``, ``ckptq verify --help`` and an
argument error (``ckptq reshard`` without arguments, exit 2). The ``ckptq`` console script of this
interpreter's environment is used when installed, else ``python -m ckptq``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _ckptq(root: Path) -> list[str]:
    exe = Path(sys.executable).parent / "ckptq"
    return [str(exe)] if exe.is_file() and root == ROOT else [sys.executable, "-m", "ckptq"]


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _time(argv: list[str], repeat: int, env: dict, cwd: Path) -> dict:
    """Median / min wall seconds and median CPU seconds (user + system) of ``argv`` (a fresh process
    each time; one warm-up run first). On a busy machine the CPU time is the steadier number: the
    start is one thread, so on an idle machine its wall time is about its CPU time."""
    subprocess.run(argv, capture_output=True, env=env, cwd=cwd)
    times, cpu, rc = [], [], None
    for _ in range(repeat):
        c0, t0 = _children_cpu(), time.perf_counter()
        rc = subprocess.run(argv, capture_output=True, env=env, cwd=cwd).returncode
        times.append(time.perf_counter() - t0)
        cpu.append(_children_cpu() - c0)
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "cpu_median_s": statistics.median(cpu),
        "exit_code": rc,
    }


def _imports_torch(ckptq_args: list[str], env: dict, cwd: Path) -> bool:
    """Whether ``ckptq <ckptq_args>`` imports torch (``python -X importtime -m ckptq ...``)."""
    argv = [sys.executable, "-X", "importtime", "-m", "ckptq", *ckptq_args]
    err = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd).stderr
    return any(line.split("|")[-1].strip() == "torch" for line in err.splitlines())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--json", type=Path, help="also write the results as JSON here")
    ap.add_argument("--root", type=Path, default=ROOT, help="the ckptq checkout to time (default: this one)")
    args = ap.parse_args()
    root = args.root.resolve()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    ckptq = _ckptq(root)
    cases = {
        "python -c pass (baseline)": [sys.executable, "-c", "pass"],
        "ckptq --help": [*ckptq, "--help"],
        "ckptq --version": [*ckptq, "--version"],
        "ckptq verify --help": [*ckptq, "verify", "--help"],
        "ckptq reshard (argument error)": [*ckptq, "reshard"],
    }
    results = {}
    for name, argv in cases.items():
        results[name] = _time(argv, args.repeat, env, root)
        if name.startswith("ckptq"):
            results[name]["imports_torch"] = _imports_torch(argv[len(ckptq) :], env, root)
        r = results[name]
        print(
            f"{name:32s} wall median {r['median_s'] * 1e3:7.1f} ms  min {r['min_s'] * 1e3:7.1f} ms  "
            f"cpu median {r['cpu_median_s'] * 1e3:7.1f} ms  "
            f"exit {r['exit_code']}" + (f"  torch imported: {r['imports_torch']}" if "imports_torch" in r else ""),
            flush=True,
        )
    machine = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "load_avg_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "command": " ".join(ckptq),
        "root": str(root),
        "repeat": args.repeat,
    }
    print(f"machine: {machine}")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "results": results}, indent=2))


if __name__ == "__main__":
    main()
