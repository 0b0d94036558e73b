"""Every snippet of README.md runs, so that none can rot.

The README is run as a user would run it, top to bottom, in a fresh empty working directory and a
fresh interpreter (this file run as a script: ``python tests/test_readme.py README.md``):

- each ```` ```python ```` block is executed in one namespace shared by the whole README (later
  snippets may use names and files of earlier ones); a traceback points at README.md's own lines;
- each ``ckptq ...`` line of a ```` ```sh ```` block (``\\`` continuations joined, ``# comments``
  dropped) is run with this environment's ``ckptq`` command in the same directory, where the
  checkpoints of the Python snippets are, and must exit 0. An optional part written
  `` [--flag ...]`` is run both ways: first with it, then without it. Other shell lines (the
  install commands at the top, which are how this suite itself is run) are listed, not run;
- a block whose first line is ``# not run by tests: REASON`` (e.g. one that needs torchrun or
  GPUs) is skipped with that reason printed.

A fresh interpreter matters: a snippet that works only because some other code already imported a
submodule (``ckptq.io``, say) must fail here as it would for a user.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
SKIP_MARK = "# not run by tests:"
_FENCE = re.compile(r"^```(\w*)[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
_OPTIONAL = re.compile(r"\s\[(-[^\]]*)\]")  # " [--dry-run]", " [--min-sqnr 30]"


def blocks(text: str) -> list[tuple[str, str, int]]:
    """``(language, code, line of the code's first line)`` of every fenced block, in order."""
    return [(m.group(1), m.group(2), text.count("\n", 0, m.start(2)) + 1) for m in _FENCE.finditer(text)]


def shell_commands(code: str, first_line: int) -> list[tuple[int, str]]:
    """``(line, command)`` of each command of a shell block: continuations joined, comments dropped."""
    out, pending, start = [], "", None
    for i, line in enumerate(code.splitlines()):
        if start is None:
            start = first_line + i
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        joined = " ".join(shlex.split(pending + line, comments=True, posix=False))
        if joined:
            out.append((start, joined))
        pending, start = "", None
    return out


def variants(command: str) -> list[str]:
    """The command with its `` [optional]`` parts, then without them (just itself if it has none)."""
    if not _OPTIONAL.search(command):
        return [command]
    return [_OPTIONAL.sub(lambda m: " " + m.group(1), command), _OPTIONAL.sub("", command)]


def run_readme(path: Path) -> int:
    """Run every snippet of ``path`` in the current directory; 0 when all pass, else 1 (at the first
    failure, which is printed with the README line)."""
    text = path.read_text()
    namespace: dict = {"__name__": "__readme__"}
    for lang, code, line in blocks(text):
        where = f"{path.name}:{line}"
        if code.lstrip().startswith(SKIP_MARK):
            print(f"{where}: skipped ({code.lstrip()[len(SKIP_MARK) :].splitlines()[0].strip()})", flush=True)
            continue
        if lang == "python":
            t0 = time.perf_counter()
            try:
                # padded with newlines, so that a traceback names the README's own line numbers
                exec(compile("\n" * (line - 1) + code, str(path), "exec"), namespace)
            except BaseException:
                import traceback

                print(f"{where}: python snippet FAILED", flush=True)
                traceback.print_exc()
                return 1
            print(f"{where}: python ok ({time.perf_counter() - t0:.1f} s)", flush=True)
        elif lang in ("sh", "bash", "shell", "console"):
            for cmd_line, command in shell_commands(code, line):
                if command.split()[0] != "ckptq":
                    print(f"{path.name}:{cmd_line}: not run (not a ckptq command): {command[:70]}...", flush=True)
                    continue
                for variant in variants(command):
                    t0 = time.perf_counter()
                    argv = _console_command() + shlex.split(variant)[1:]
                    r = subprocess.run(argv, capture_output=True, text=True)
                    status = "ok" if r.returncode == 0 else f"FAILED (exit {r.returncode})"
                    print(
                        f"{path.name}:{cmd_line}: $ {variant}  -> {status} ({time.perf_counter() - t0:.1f} s)",
                        flush=True,
                    )
                    if r.returncode != 0:
                        print(r.stdout[-3000:], r.stderr[-3000:], sep="\n", flush=True)
                        return 1
    return 0


def _console_command() -> list[str]:
    """``ckptq.cli.console_command()``, asked of a child interpreter: importing ``ckptq.cli`` here
    would import ``ckptq.io`` and hide a README snippet that forgets to."""
    code = "import json; from ckptq.cli import console_command; print(json.dumps(console_command()))"
    return json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


# ----------------------------------------------------------------------------------------- tests
def _run(readme: Path, cwd: Path) -> subprocess.CompletedProcess:
    # the checkout importable without an install, as in conftest.py (the CLI then runs ckptq.cli:main)
    path = os.pathsep.join(filter(None, [str(README.parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run(
        [sys.executable, __file__, str(readme)], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def test_readme_snippets_run(tmp_path):
    r = _run(README, tmp_path)
    assert r.returncode == 0, f"a README snippet failed:\n{r.stdout[-6000:]}\n{r.stderr[-6000:]}"


def test_the_snippets_cover_python_and_the_cli():
    text = README.read_text()
    found = blocks(text)
    python = [code for lang, code, _ in found if lang == "python"]
    assert any("SafeFileSystemReader" in c for c in python)  # the safe-load recipe is a run snippet
    commands = [c for lang, code, line in found if lang == "sh" for _, c in shell_commands(code, line)]
    for sub in ("inspect", "reshard", "convert", "verify"):
        assert any(c.startswith(f"ckptq {sub} ") for c in commands), sub


def test_parsing():
    text = "x\n```sh\nckptq a b \\\n   --c 'd*' [--e]   # note\npip install x\n```\n```python\nprint(1)\n```\n"
    (sh, code, line), (py, pcode, pline) = blocks(text)
    assert (sh, line, py, pcode, pline) == ("sh", 3, "python", "print(1)\n", 8)
    assert shell_commands(code, line) == [(3, "ckptq a b --c 'd*' [--e]"), (5, "pip install x")]
    assert variants("ckptq a b --c 'd*' [--e]") == ["ckptq a b --c 'd*' --e", "ckptq a b --c 'd*'"]
    assert variants("ckptq x '*.[0-9].w=col'") == ["ckptq x '*.[0-9].w=col'"]


def test_a_broken_snippet_fails(tmp_path):
    bad_python = tmp_path / "python.md"
    bad_python.write_text("```python\nx = 1\n```\n\n```python\nassert x == 2, 'x is 1'\n```\n")
    r = _run(bad_python, tmp_path)
    assert r.returncode == 1 and "python.md:6: python snippet FAILED" in r.stdout and "x is 1" in r.stderr
    bad_cli = tmp_path / "cli.md"
    bad_cli.write_text("```sh\nckptq inspect no-such-checkpoint\n```\n")
    r = _run(bad_cli, tmp_path)
    assert r.returncode == 1 and "cli.md:2: $ ckptq inspect no-such-checkpoint  -> FAILED (exit" in r.stdout


if __name__ == "__main__":
    sys.exit(run_readme(Path(sys.argv[1]) if len(sys.argv) > 1 else README))
