"""Where the offline tools compute, and the stream that feeds the device while the next tensor is read.

``ckptq reshard|convert|export --device cpu|cuda|cuda:N|auto`` (:func:`resolve_device`): tensors that
are re-encoded or dequantized go through :func:`prefetch`, which reads the next source tensor on a
thread while the current one is computed. On a CUDA device the reader thread also copies what needs
computing into pinned host memory and onto the device on a side stream (``non_blocking``); the
consumer waits for that copy only, computes with the device's kernels (:mod:`ckptq.ops` serves a
CUDA tensor with the CUDA backend, the same bytes as the CPU and reference ones) and brings the
result back with :func:`to_host` (pinned host buffers, one synchronization). Values that are
copied as they are (same format and recipe, a plain tensor) never leave the host.

Memory: at most ``depth`` read values wait in the queue, plus the one being read and the one being
computed (on the device: that one and its result).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ..errors import UsageError
from ..formats.base import QuantizedTensor

__all__ = ["DEVICES", "resolve_device", "device_scope", "prefetch", "to_device", "to_host", "PrefetchStats"]

#: The spellings ``--device`` takes (besides ``cuda:N``).
DEVICES = ("auto", "cpu", "cuda")


def _cuda_ready() -> tuple[bool, str]:
    """Whether the CUDA kernels can run here, and why not."""
    from ..ops import _backends

    if not torch.cuda.is_available():
        return False, "torch sees no CUDA device" + (
            "" if torch.version.cuda else f" ({torch.__version__} is a CPU build)"
        )
    active, reason, _ = _backends.status("cuda")
    return active, reason


def resolve_device(spec: str | torch.device | None = "auto") -> torch.device:
    """The device ``--device`` names: ``"cpu"``, ``"cuda"`` / ``"cuda:N"`` (must be usable: a CUDA
    device and ckptq's CUDA kernels loaded), or ``"auto"`` / None (``cuda`` when it is usable and
    ``CKPTQ_BACKEND`` forces no other backend, else ``cpu``). A CUDA device comes back with its index
    (``cuda`` and ``auto``: the current device).

    Raises:
        UsageError: an unknown spelling, or a CUDA device that cannot be used (the reason and the fix).
    """
    if isinstance(spec, torch.device):
        spec = str(spec)
    text = (spec or "auto").strip().lower()
    if text == "auto":  # a CKPTQ_BACKEND forcing cpu or reference keeps the work on the CPU
        from ..ops import _backends

        if _backends.forced() in (None, "cuda") and _cuda_ready()[0]:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    if text == "cpu":
        return torch.device("cpu")
    if text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit()):
        ok, why = _cuda_ready()
        if not ok:
            raise UsageError(f"--device {text}: the CUDA kernels cannot run here ({why}); use --device cpu or auto")
        dev = torch.device(text)
        if dev.index is None:  # the current device, named (torch.cuda.set_device needs an index)
            return torch.device("cuda", torch.cuda.current_device())
        if dev.index >= torch.cuda.device_count():
            raise UsageError(
                f"--device {text}: there are {torch.cuda.device_count()} CUDA device(s) (cuda:0.."
                f"cuda:{torch.cuda.device_count() - 1})"
            )
        return dev
    raise UsageError(f"--device: '{spec}' is not one of {list(DEVICES)} or cuda:N")


def _map(x: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``x`` (a tensor, a QuantizedTensor, or a list/tuple of them) with ``fn`` applied to every plain tensor."""
    if isinstance(x, QuantizedTensor):
        return x._rebuild(lambda _k, v: fn(v))
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_map(v, fn) for v in x)
    return x


def to_device(x: Any, device: torch.device, stream: Any = None) -> Any:
    """``x`` on ``device``: on CUDA, through pinned host memory with ``non_blocking`` copies on
    ``stream`` (the caller waits for the stream before using the result); on the CPU, ``x`` itself."""
    if device.type != "cuda":
        return x

    def move(t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cuda":
            return t
        host = t if t.is_pinned() else t.pin_memory()
        return host.to(device, non_blocking=True)

    if stream is None:
        return _map(x, move)
    with torch.cuda.stream(stream):
        return _map(x, move)


def to_host(x: Any) -> Any:
    """``x`` (tensors / QuantizedTensors, maybe on a CUDA device) on the CPU: device tensors are copied
    into pinned host buffers with ``non_blocking`` copies and one synchronization at the end."""
    devices = set()

    def move(t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu":
            return t
        devices.add(t.device)
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host

    out = _map(x, move)
    for dev in devices:
        torch.cuda.current_stream(dev).synchronize()
    return out


class PrefetchStats:
    """What :func:`prefetch` measured: ``read_s`` (seconds the reader thread spent reading, overlapped
    with the consumer's work), ``wait_s`` (seconds the consumer waited for a value), ``to_device``
    (values moved to the device)."""

    def __init__(self) -> None:
        self.read_s = 0.0
        self.wait_s = 0.0
        self.to_device = 0


_END = object()


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


def prefetch(
    items: Iterable[Any],
    read: Callable[[Any], Any],
    *,
    device: torch.device,
    wants_device: Callable[[Any, Any], bool] = lambda item, value: False,
    depth: int = 1,
    stats: PrefetchStats | None = None,
) -> Iterator[tuple[Any, Any]]:
    """Yield ``(item, value)`` for each of ``items`` in order, ``value = read(item)`` computed ahead on
    one thread (at most ``depth`` values waiting). Where ``device`` is a CUDA device and
    ``wants_device(item, value)``, the value arrives on the device (copied on a side stream; the
    current stream waits for that copy before the value is yielded); else as read (host).

    ``read`` runs on the reader thread only (not concurrently with itself). An exception it raises is
    raised here, at its item; closing the generator early stops the thread.
    """
    q: queue.Queue = queue.Queue(maxsize=max(1, depth))
    stop = threading.Event()
    stats = stats if stats is not None else PrefetchStats()
    side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def put(v: Any) -> bool:
        while not stop.is_set():
            try:
                q.put(v, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        if side is not None:
            torch.cuda.set_device(device)
        try:
            for item in items:
                if stop.is_set():
                    return
                t0 = time.perf_counter()
                value = read(item)
                event = None
                if side is not None and wants_device(item, value):
                    value = to_device(value, device, side)
                    event = torch.cuda.Event()
                    event.record(side)
                    stats.to_device += 1
                stats.read_s += time.perf_counter() - t0
                if not put((item, value, event)):
                    return
            put(_END)
        except BaseException as e:  # noqa: BLE001 - raised on the consumer's thread
            put(_Failed(e))

    thread = threading.Thread(target=work, name="ckptq-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            t0 = time.perf_counter()
            got = q.get()
            stats.wait_s += time.perf_counter() - t0
            if got is _END:
                return
            if isinstance(got, _Failed):
                raise got.error
            item, value, event = got
            if event is not None:
                _use_on_current_stream(value, device, event)
            yield item, value
    finally:
        stop.set()
        thread.join()


def _use_on_current_stream(value: Any, device: torch.device, event: Any) -> None:
    """Make ``device``'s current stream wait for ``event`` (the copy of ``value`` on the side stream),
    and tell the caching allocator that ``value``'s memory is used on that stream too."""
    main = torch.cuda.current_stream(device)
    main.wait_event(event)

    def mark(t: torch.Tensor) -> torch.Tensor:
        t.record_stream(main)
        return t

    _map(value, mark)


def device_scope(device: torch.device) -> Any:
    """A ``with`` context that makes ``device`` the current CUDA device (nothing for the CPU)."""
    import contextlib

    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
