"""Run PyTorch's own DCP tests twice: with DCP's default planners, and with ckptq's in their place.

One command::

    python scripts/run_dcp_upstream_tests.py DIR [DIR_OR_FILE ...] [--json out.json] [-k EXPR] [--timeout S]

``DIR`` holds test files of PyTorch's ``test/distributed/checkpoint`` (e.g. ``test_planner.py``,
``test_file_system_checkpoint_cpu.py``) taken from the PyTorch release of the installed torch; they
are not part of this repository. Each file is run with pytest twice:

* ``dcp``: as it is;
* ``ckptq``: with :class:`ckptq.QuantizedSavePlanner` / :class:`ckptq.QuantizedLoadPlanner` bound to
  the names ``DefaultSavePlanner`` / ``DefaultLoadPlanner`` in every loaded
  ``torch.distributed.checkpoint`` module (the package, ``default_planner``, ``state_dict_saver`` and
  ``state_dict_loader``, where ``dcp.save`` / ``dcp.load`` make their default planner, ...) before
  the test modules are imported, so the tests' own ``DefaultSavePlanner(...)`` calls make ckptq's
  planners too. The substitution is installed by a ``sitecustomize`` module on ``PYTHONPATH``
  (enabled by an environment variable), so the processes that multi-process tests spawn get it as
  well. Every construction of a ckptq planner is logged, and the run reports how many there were:
  a substitution that did not take would show 0.

Reported per file: passed / failed / skipped with the defaults and with ckptq's planners, and every
test that passes with the defaults and fails with ckptq's (exit status 1 when there is one). Tests
that need CUDA or NCCL skip on a machine without them.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ENV_FLAG = "CKPTQ_DCP_SUBSTITUTE_PLANNERS"
ENV_LOG = "CKPTQ_DCP_SUBSTITUTE_LOG"
ROOT = Path(__file__).resolve().parent.parent


def install() -> None:
    """Bind ckptq's planners to DCP's default planner names in every loaded DCP module (no-op
    unless :data:`ENV_FLAG` is set). Called from the generated ``sitecustomize``."""
    if os.environ.get(ENV_FLAG) != "1":
        return
    import importlib

    import torch.distributed.checkpoint  # noqa: F401 - loads the package and its submodules
    from torch.distributed.checkpoint import default_planner

    import ckptq

    for name in ("state_dict_saver", "state_dict_loader", "format_utils", "optimizer"):
        importlib.import_module(f"torch.distributed.checkpoint.{name}")
    log = os.environ.get(ENV_LOG)
    swaps = {
        default_planner.DefaultSavePlanner: _logged(ckptq.QuantizedSavePlanner, log),
        default_planner.DefaultLoadPlanner: _logged(ckptq.QuantizedLoadPlanner, log),
    }
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not mod_name.startswith("torch.distributed.checkpoint"):
            continue
        for attr in ("DefaultSavePlanner", "DefaultLoadPlanner"):
            if getattr(mod, attr, None) in swaps:
                setattr(mod, attr, swaps[getattr(mod, attr)])


def _logged(cls: type, log: str | None) -> type:
    """``cls`` with each construction appended to ``log`` (the class keeps its name, so that DCP's
    plan-cache keys and messages are the ones ckptq's planner has)."""
    if not log:
        return cls
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {cls.__name__}\n")

    cls.__init__ = __init__
    return cls


def _outcomes(junit: Path) -> dict[str, dict[str, str]]:
    """file name -> {test id: "passed" | "failed" | "skipped"} from a pytest junit XML report."""
    out: dict[str, dict[str, str]] = collections.defaultdict(dict)
    if not junit.exists():
        return out
    for case in ET.parse(junit).iter("testcase"):
        file = Path(case.get("file") or case.get("classname", "").split(".")[0] + ".py").name
        test = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        tags = {child.tag for child in case}
        outcome = "failed" if tags & {"failure", "error"} else "skipped" if "skipped" in tags else "passed"
        out[file][test] = outcome
    return out


def run_mode(files: list[Path], mode: str, work: Path, args: argparse.Namespace) -> tuple[dict, int, str]:
    """Run pytest on ``files`` in ``mode`` ("dcp" or "ckptq"); outcomes, planner constructions, tail."""
    junit, log = work / f"{mode}.xml", work / f"{mode}.planners"
    log.write_text("")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(work / "site"), str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env[ENV_FLAG] = "1" if mode == "ckptq" else "0"
    env[ENV_LOG] = str(log)
    cmd = [sys.executable, "-m", "pytest", *map(str, files), "-q", "-p", "no:cacheprovider"]
    cmd += ["-o", "junit_family=xunit1", f"--junitxml={junit}", "-rN"]
    if args.k:
        cmd += ["-k", args.k]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout, cwd=work)
        tail = (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as e:
        tail = f"timed out after {args.timeout} s\n{(e.stdout or b'')[-2000:]!r}"
    constructed = len(log.read_text().splitlines())
    return _outcomes(junit), constructed, tail


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", type=Path, help="upstream test files or directories of test_*.py")
    ap.add_argument("--json", type=Path, help="write the outcomes of every test here")
    ap.add_argument("-k", help="pytest -k expression")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per pytest run")
    args = ap.parse_args(argv)
    files = sorted({f.resolve() for p in args.paths for f in (sorted(p.glob("test_*.py")) if p.is_dir() else [p])})
    if not files:
        ap.error("no test files")
    with tempfile.TemporaryDirectory(prefix="ckptq-dcp-upstream-") as tmp:
        work = Path(tmp)
        (work / "site").mkdir()
        (work / "site" / "sitecustomize.py").write_text(
            f"import sys\nsys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"
            "import run_dcp_upstream_tests\nrun_dcp_upstream_tests.install()\n"
        )
        results, constructed, tails = {}, {}, {}
        for mode in ("dcp", "ckptq"):
            results[mode], constructed[mode], tails[mode] = run_mode(files, mode, work, args)
    import torch

    print(f"torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()}")
    print(f"ckptq planners constructed: {constructed['ckptq']} with substitution, {constructed['dcp']} without")
    print()
    print("| file | defaults: passed / failed / skipped | ckptq: passed / failed / skipped |")
    print("| --- | --- | --- |")
    regressions = []
    for f in files:
        row = [f.name]
        for mode in ("dcp", "ckptq"):
            counts = collections.Counter(results[mode].get(f.name, {}).values())
            row.append(f"{counts['passed']} / {counts['failed']} / {counts['skipped']}")
        print("| " + " | ".join(row) + " |")
        ours = results["ckptq"].get(f.name, {})
        for test, outcome in results["dcp"].get(f.name, {}).items():
            if outcome == "passed" and ours.get(test) != "passed":
                regressions.append(f"{f.name}::{test} ({ours.get(test, 'not run')} with ckptq)")
    print()
    if regressions:
        print("Pass with the default planners, not with ckptq's:")
        print("\n".join(f"  {r}" for r in regressions))
    else:
        print("Every test that passes with the default planners passes with ckptq's.")
    for mode in ("dcp", "ckptq"):
        if not results[mode]:
            print(f"\n[{mode}] no junit report; pytest said:\n{tails[mode]}")
    if args.json:
        args.json.write_text(json.dumps({"torch": torch.__version__, "constructed": constructed, **results}, indent=1))
    return 1 if regressions or not constructed["ckptq"] else 0


if __name__ == "__main__":
    sys.exit(main())
