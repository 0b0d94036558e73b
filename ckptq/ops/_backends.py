"""Loading of the compiled backends, and the choice of backend per device.

Backends, fastest first: ``cuda`` (``ckptq._C_cuda``, CUDA tensors) and ``cpu`` (``ckptq._C``, CPU
tensors); ``reference`` (pure PyTorch, :mod:`ckptq.numerics`) always works and is the spec.

* The extensions are imported lazily, the first time a backend is asked for, each inside
  ``try/except``: a missing or broken ``.so`` (not built, built against another torch, missing CUDA
  libraries) only makes that backend inactive, with the reason recorded for :func:`report`.
* Unforced, a tensor whose device has no active backend falls back to ``reference`` with ONE
  ``RuntimeWarning`` per missing backend per process.
* ``CKPTQ_BACKEND=reference|cpu|cuda`` (read at every call) forces a backend: ``reference`` for
  everything; ``cpu`` / ``cuda`` for the tensors of their device (tensors on other devices use the
  reference). Forcing a backend that is not active raises :class:`ckptq.errors.CkptqError` with the
  reason, rather than silently running something else.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
import warnings
from collections.abc import Iterator

import torch

from ..errors import CkptqError
from . import _library  # noqa: F401  (defines the op schemas before any .so registers kernels)

__all__ = ["BACKENDS", "select", "status", "report", "forced", "force", "reset"]

BACKENDS = ("reference", "cpu", "cuda")
_MODULES = {"cpu": "ckptq._C", "cuda": "ckptq._C_cuda"}
_DISPATCH_KEY = {"cpu": "CPU", "cuda": "CUDA"}

_lock = threading.Lock()
_state: dict[str, tuple[bool, str, str | None]] = {}  # name -> (active, reason, path)
_warned: set[str] = set()
_local = threading.local()


def _try_load(name: str) -> tuple[bool, str, str | None]:
    if name == "cuda":
        if torch.version.cuda is None:
            return False, f"PyTorch {torch.__version__} is not a CUDA build", None
    try:
        mod = importlib.import_module(_MODULES[name])
    except ImportError as e:
        msg = str(e)
        if "No module named" in msg:
            return (
                False,
                (
                    f"extension {_MODULES[name]} is not built (build with `pip install --no-build-isolation -e .`"
                    f"{'' if name == 'cpu' else ' on a machine with a CUDA torch and nvcc'}; "
                    f"CKPTQ_NO_EXT=1 skips it)"
                ),
                None,
            )
        return False, f"extension {_MODULES[name]} failed to load: {msg}", None
    except Exception as e:  # a broken .so can raise OSError and friends
        return False, f"extension {_MODULES[name]} failed to load: {type(e).__name__}: {e}", None
    path = getattr(mod, "__file__", None)
    for op in ("ckptq::requantize", "ckptq::amax"):
        if not torch._C._dispatch_has_kernel_for_dispatch_key(op, _DISPATCH_KEY[name]):
            return False, f"{path} loaded but registered no {_DISPATCH_KEY[name]} kernel for {op}", path
    if name == "cuda" and not torch.cuda.is_available():
        return False, f"kernels loaded from {path}, but no CUDA device is available", path
    extra = f", {torch.get_num_threads()} threads" if name == "cpu" else ""
    return True, f"C++ kernels loaded from {path}{extra}", path


def status(name: str) -> tuple[bool, str, str | None]:
    """``(active, reason, path)`` of backend ``name`` (loads it on first call)."""
    if name == "reference":
        return True, "pure PyTorch (ckptq.numerics), always available; the spec", None
    with _lock:
        if name not in _state:
            _state[name] = _try_load(name)
        return _state[name]


def reset() -> None:
    """Forget load results and warnings (tests)."""
    with _lock:
        _state.clear()
        _warned.clear()


def forced() -> str | None:
    """The forced backend: :func:`force` context, else ``CKPTQ_BACKEND``, else None."""
    name = getattr(_local, "forced", None) or os.environ.get("CKPTQ_BACKEND") or None
    if name is not None and name not in BACKENDS:
        raise CkptqError(f"CKPTQ_BACKEND={name!r} is not a backend; choose one of {list(BACKENDS)}")
    return name


@contextlib.contextmanager
def force(name: str | None) -> Iterator[None]:
    """Force backend ``name`` (or clear a force with None) in this thread for the ``with`` body."""
    if name is not None and name not in BACKENDS:
        raise CkptqError(f"unknown backend {name!r}; choose one of {list(BACKENDS)}")
    prev = getattr(_local, "forced", None)
    _local.forced = name
    try:
        yield
    finally:
        _local.forced = prev


def select(device: torch.device | str) -> str:
    """The backend that serves tensors on ``device`` now (see the module docstring)."""
    dev = torch.device(device).type
    native = dev if dev in ("cpu", "cuda") else None
    f = forced()
    if f == "reference":
        return "reference"
    if f is not None:
        if f != native:
            return "reference"
        active, reason, _ = status(f)
        if not active:
            raise CkptqError(f"CKPTQ_BACKEND={f} is forced but that backend is not active: {reason}")
        return f
    if native is None:
        return "reference"
    active, reason, _ = status(native)
    if active:
        return native
    if native not in _warned:
        _warned.add(native)
        warnings.warn(
            f"ckptq: the {native} kernels are unavailable ({reason}); using the pure-PyTorch reference "
            f"backend for {native} tensors (same bytes, slower).",
            RuntimeWarning,
            stacklevel=3,
        )
    return "reference"


def report() -> dict:
    """Torch version and, per backend, whether it is active and why not (``ckptq doctor``)."""
    backends = {}
    for name in BACKENDS:
        active, reason, path = status(name)
        backends[name] = {"active": active, "reason": reason}
        if path:
            backends[name]["path"] = path
    try:
        f = forced()
    except CkptqError as e:
        f = f"invalid: {e}"
    return {
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_device": torch.cuda.get_device_name(0) if backends["cuda"]["active"] else None,
        "forced": f,
        "backends": backends,
    }
