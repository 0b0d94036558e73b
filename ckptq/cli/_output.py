"""The CLI's single output layer: data to stdout (tables via tabulate, or JSON), everything else
(logs, warnings, errors) to stderr, as the ``hf`` CLI does."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

import typer

__all__ = [
    "echo",
    "echo_json",
    "echo_table",
    "log",
    "warning",
    "error",
    "fail",
    "usage_error",
    "jsonable",
    "format_bytes",
    "format_number",
    "progress_enabled",
    "byte_progress",
]


def echo(text: str = "") -> None:
    """A line of data to stdout."""
    typer.echo(text)


def jsonable(obj: Any) -> Any:
    """``obj`` with non-finite floats replaced by the strings ``"nan"``, ``"inf"``, ``"-inf"`` (strict
    JSON has no NaN/Infinity) and tuples as lists."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


def echo_json(obj: Any) -> None:
    """``obj`` as strict, indented JSON to stdout (see :func:`jsonable`)."""
    typer.echo(json.dumps(jsonable(obj), indent=2, allow_nan=False))


def echo_table(rows: Sequence[Sequence[Any]], headers: Sequence[str], *, empty: str = "No results found.") -> None:
    """A table to stdout (tabulate ``simple`` format; ``empty`` when there are no rows)."""
    if not rows:
        typer.echo(empty)
        return
    from tabulate import tabulate  # imported here: ``ckptq --help`` does not need it

    typer.echo(tabulate(rows, headers=list(headers), tablefmt="simple", disable_numparse=True))


def log(message: str) -> None:
    """An informational line to stderr."""
    typer.echo(message, err=True)


def warning(message: str) -> None:
    """``Warning: <message>`` to stderr."""
    typer.echo(f"Warning: {message}", err=True)


def error(message: str) -> None:
    """``Error: <message>`` to stderr."""
    typer.echo(f"Error: {message}", err=True)


def fail(message: str) -> NoReturn:
    """Report a failed check (``Error: <message>`` to stderr) and exit 1."""
    error(message)
    raise typer.Exit(1)


def usage_error(message: str, command: str | None = None) -> NoReturn:
    """Report a usage error (``Error: <message>``, then typer's ``Try '<command> --help' for help.``
    when ``command`` is given) to stderr and exit 2."""
    error(message)
    if command:
        log(f"Try '{command} --help' for help.")
    raise typer.Exit(2)


def format_bytes(n: int | None) -> str:
    """``1536`` -> ``"1.50 KiB"`` (binary units); ``None`` -> ``"-"``."""
    if n is None:
        return "-"
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024.0
        if value < 1024 or unit == "PiB":
            return f"{value:.2f} {unit}"
    raise AssertionError("unreachable")


def format_number(x: Any, spec: str = ".4g") -> str:
    """A number for a table cell: floats with ``spec``, lists as ``min..max``, ``None`` as ``-``."""
    if x is None:
        return "-"
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, float):
        return format(x, spec)
    if isinstance(x, (list, tuple)):
        vals = [v for v in x if v is not None]
        if not vals:
            return "-"
        return (
            format_number(vals[0], spec)
            if len(vals) == 1
            else f"{format_number(min(vals), spec)}..{format_number(max(vals), spec)}"
        )
    return str(x)


def progress_enabled() -> bool:
    """Progress bars go to stderr, only on a terminal and unless ``CKPTQ_DISABLE_PROGRESS_BARS=1``."""
    if os.environ.get("CKPTQ_DISABLE_PROGRESS_BARS", "") not in ("", "0"):
        return False
    return bool(getattr(sys.stderr, "isatty", lambda: False)())


class _Bar:
    """What :func:`byte_progress` yields: call it with an amount done; :meth:`set_total` gives the bar
    its total (then it shows a percentage and an ETA). Both are no-ops without a bar."""

    def __init__(self, bar: Any = None):
        self._bar = bar

    def __call__(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def set_total(self, total: int) -> None:
        if self._bar is not None:
            self._bar.total = total
            self._bar.refresh()


@contextlib.contextmanager
def byte_progress(desc: str, total: int | None = None, *, unit: str = "B") -> Iterator[_Bar]:
    """A tqdm bar on stderr (when :func:`progress_enabled`) of bytes done and bytes/s (``unit="B"``)
    or of items (another ``unit``, e.g. ``"tensor"``); yields a :class:`_Bar` to call with each
    amount done and to give the total once known."""
    if not progress_enabled():
        yield _Bar()
        return
    from tqdm import tqdm

    scale = dict(unit_scale=True, unit_divisor=1024) if unit == "B" else {}
    with tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, **scale) as bar:
        yield _Bar(bar)
