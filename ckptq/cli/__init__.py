"""The ``ckptq`` command line: ``ckptq inspect``, ``ckptq doctor``, ...

Layout (one module per command, as the ``hf`` CLI):

- ``_app.py``: the root Typer ``app``, the :func:`command` decorator (registration + error boundary)
  and :func:`main` (the console-script entry point);
- ``_output.py``: the only place that writes: data (tables, JSON) to stdout, logs and errors to stderr;
- ``_options.py``: shared ``Annotated`` argument/option types (``JsonOpt``, ``CheckpointArg``);
- ``<command>.py``: one public module per command, discovered automatically. Adding a command is a
  one-file job: create ``ckptq/cli/<name>.py`` with a function decorated ``@command("<name>")``.

Exit codes: 0 ok, 1 error (a :class:`ckptq.CkptqError`, an OS error, or a failed check), 2 usage
error. ``CKPTQ_DEBUG=1`` prints the traceback of an error.
"""

from __future__ import annotations

import importlib
import pkgutil

from ._app import app, command, console_command, main

__all__ = ["app", "command", "main", "console_command"]


def _load_commands() -> None:
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")


_load_commands()
