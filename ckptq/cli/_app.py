"""The root Typer app, command registration with one error boundary, and ``main``."""

from __future__ import annotations

import functools
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import typer

from ..errors import CkptqError, UsageError
from . import _output

__all__ = ["app", "command", "main", "debug_enabled", "console_command", "examples_epilog"]

app = typer.Typer(
    name="ckptq",
    help="Inspect, reshard, convert and verify checkpoints of quantized tensors (FP8, MXFP8, NVFP4).",
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion (bash, zsh, fish, PowerShell)
    # Click's plain help: rich is not imported (help stays quick) and flags print without a type.
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
    pretty_exceptions_enable=False,
)


def debug_enabled() -> bool:
    """True when ``CKPTQ_DEBUG`` is set to a non-empty value other than ``0``."""
    return os.environ.get("CKPTQ_DEBUG", "") not in ("", "0")


def _version_callback(value: bool) -> None:
    if value:
        from .. import __version__

        typer.echo(f"ckptq {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", help="Print the ckptq version and exit.", callback=_version_callback, is_eager=True
    ),
) -> None:
    """Inspect, reshard, convert and verify checkpoints of quantized tensors (FP8, MXFP8, NVFP4)."""


def examples_epilog(examples: list[str]) -> str:
    """An ``Examples:`` help epilog, one ``ckptq ...`` command line per item, kept unwrapped."""
    return "\b\nExamples:\n" + "\n".join(f"  {e}" for e in examples)


def command(
    name: str | None = None, *, examples: list[str] | None = None, **kwargs: Any
) -> Callable[[Callable], Callable]:
    """Register a function as ``ckptq <name>`` behind the CLI's error boundary.

    Inside the command, a :class:`ckptq.UsageError` (option text that does not parse) prints
    ``Error: <message>`` and typer's ``Try '... --help' for help.`` to stderr and exits 2; another
    :class:`ckptq.CkptqError` or an ``OSError`` prints ``Error: <message>`` and exits 1 (both with the
    traceback when ``CKPTQ_DEBUG=1``); any other exception is a bug and propagates with its
    traceback. ``typer.Exit`` passes through. Ctrl-C prints ``Aborted; nothing was written`` and
    exits 130 (every writing command stages its output and removes the staging folder on the way out).

    Args:
        name: the command name (default: the function name).
        examples: command lines shown under ``Examples:`` at the end of the command's ``--help``.
        **kwargs: passed to ``app.command`` (``help``, ``hidden``, ...).
    """

    def deco(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kw: Any) -> Any:
            try:
                return fn(*args, **kw)
            except (CkptqError, OSError) as e:
                if debug_enabled():
                    traceback.print_exc(file=sys.stderr)
                if isinstance(e, UsageError):
                    _output.usage_error(str(e), f"ckptq {name or fn.__name__}")
                _output.error(str(e) or type(e).__name__)
                raise typer.Exit(1) from None
            except KeyboardInterrupt:
                _output.log("Aborted; nothing was written")
                raise typer.Exit(130) from None

        if examples:
            kwargs.setdefault("epilog", examples_epilog(examples))
        app.command(name, **kwargs)(wrapper)
        return fn

    return deco


def main() -> None:
    """Console-script entry point (``ckptq = "ckptq.cli:main"``)."""
    app(prog_name="ckptq")


def console_command() -> list[str]:
    """The argv prefix that runs this ckptq's CLI in a subprocess: the ``ckptq`` console script of
    this interpreter's environment (or on ``PATH``), else ``python -c`` of :func:`main`."""
    import shutil
    from pathlib import Path

    exe = Path(sys.executable).parent / "ckptq"
    if exe.is_file():
        return [str(exe)]
    found = shutil.which("ckptq")
    if found:
        return [found]
    return [sys.executable, "-c", "import sys; from ckptq.cli import main; sys.exit(main())"]
