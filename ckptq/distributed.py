"""Process-group plumbing of the offline tools run under ``torchrun`` (``ckptq reshard|convert``).

The offline tools split their work (the output tensors, whose records' files and offsets are fixed
in advance) over the processes of a ``torch.distributed`` job and agree through a handful of
gloo object collectives (no GPU needed): rank 0 prepares the output and broadcasts where it is, each
process writes its share, every process reports success or its error,
and only when all succeeded does rank 0 write ``.metadata`` and rename the output into place. A
process that fails makes every process raise (:class:`~ckptq.errors.CkptqError` naming the failed
ranks and their errors) and leaves no complete-looking output. :func:`prepare_write_commit` is
that protocol, with or without a group.

:func:`assign` is the work split: items (tensors) by estimated cost, largest first onto the process
with the least so far (LPT), the same on every process. :func:`file_share` is the split of an
output's target files (ranks) over the processes, for tools that plan per target rank.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from .errors import CkptqError

__all__ = [
    "Group",
    "assign",
    "expect_shared_dir",
    "file_share",
    "prepare_write_commit",
    "process_rank_size",
    "torchrun_world_size",
]

P = TypeVar("P")
R = TypeVar("R")

#: How long a collective waits for the slowest process (a share of a multi-TB job takes a while).
TIMEOUT = datetime.timedelta(hours=12)


def torchrun_world_size() -> int:
    """The number of processes torchrun (or another launcher setting ``WORLD_SIZE``) started; 1
    when run on its own."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def process_rank_size() -> tuple[int, int]:
    """(rank, number of processes) of this process in the ``torch.distributed`` job: of the default
    process group when it is initialized, else from the launcher's ``RANK`` / ``WORLD_SIZE``
    (torchrun sets them); ``(0, 1)`` when run on its own."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    try:
        return int(os.environ.get("RANK", "0")), torchrun_world_size()
    except ValueError:
        return 0, 1


def file_share(files: int, processes: int, rank: int) -> tuple[range, int, int]:
    """Which of an output's ``files`` target files (target ranks ``0..files-1``) process ``rank`` of
    ``processes`` plans and writes: ``(ranks, part, parts)``. With at least as many files as
    processes, a contiguous run of ranks of its own (``files // processes`` or one more;
    ``part, parts = 0, 1``); with fewer, one rank that ``parts`` processes share, this one being
    ``part`` of them (they split that file's work between them). The same on every process.
    """
    if files >= processes:
        return range(rank * files // processes, (rank + 1) * files // processes), 0, 1
    r = rank * files // processes
    sharing = [p for p in range(processes) if p * files // processes == r]
    return range(r, r + 1), sharing.index(rank), len(sharing)


def assign(costs: dict, processes: int, loads: list[int] | None = None) -> list[set]:
    """Split items (``{item id: cost}``, ids sortable) over ``processes``: the costliest first, each
    to the process with the least cost so far (ties: the lower rank), starting from ``loads`` (the
    work each process has already; None: none). Deterministic.

    Returns:
        ``[set of item ids]`` per process (some may be empty when there are fewer items).
    """
    loads = list(loads) if loads is not None else [0] * processes
    out: list[set] = [set() for _ in range(processes)]
    for f, b in sorted(costs.items(), key=lambda kv: (-kv[1], kv[0])):
        p = min(range(processes), key=lambda i: (loads[i], i))
        out[p].add(f)
        loads[p] += b
    return out


class Group:
    """A gloo process group over all processes of the default ``torch.distributed`` job, with the
    few object collectives the offline tools need. Every process must make the same calls in the
    same order.

    Raises:
        CkptqError: torch.distributed is unavailable, or the job's environment cannot initialize it.
    """

    def __init__(self, pg: Any, rank: int, size: int, *, owns_default: bool = False) -> None:
        self.pg, self.rank, self.size = pg, rank, size
        self._owns_default = owns_default

    @classmethod
    def default(cls) -> Group:
        """The group of every process of the job: initializes ``torch.distributed`` from the
        launcher's environment (``MASTER_ADDR``, ``RANK``, ``WORLD_SIZE``: torchrun sets them) if
        it is not yet, and makes a gloo group over it (the job's own backend may be NCCL)."""
        import torch.distributed as dist

        if not dist.is_available():
            raise CkptqError("this torch has no torch.distributed; run without torchrun")
        owns = not dist.is_initialized()
        if owns:
            try:
                dist.init_process_group("gloo", timeout=TIMEOUT)
            except Exception as e:
                raise CkptqError(
                    f"cannot join the torch.distributed job ({type(e).__name__}: {e}); start the "
                    f"processes with torchrun, or run without it"
                ) from e
        pg = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo", timeout=TIMEOUT)
        return cls(pg, dist.get_rank(), dist.get_world_size(), owns_default=owns)

    def close(self) -> None:
        """Tear down what :meth:`default` set up (the job's own process group stays): a gloo group
        left alive at interpreter exit aborts the process."""
        import torch.distributed as dist

        try:
            if self.pg is not None:
                dist.destroy_process_group(self.pg)
            elif self._owns_default and dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - teardown after the work is done or failed
            pass
        self.pg, self._owns_default = None, False

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every process."""
        import torch.distributed as dist

        box = [obj if self.rank == 0 else None]
        self._collective(dist.broadcast_object_list, box, src=0, group=self.pg)
        return box[0]

    def assign(self, costs: dict, loads: list[int] | None = None) -> set:
        """This process's items (:func:`assign`)."""
        return assign(costs, self.size, loads)[self.rank]

    def gather_ok(self, payload: Any = None, *, to_root: bool = False) -> list[Any] | None:
        """Every process's ``payload``, in rank order: on every process, or with ``to_root`` on
        rank 0 only (None elsewhere: large payloads are not copied to every process). First every
        process learns whether all succeeded: if any reported a failure (:meth:`report_failure`)
        instead, every process raises."""
        import torch.distributed as dist

        got = self._all_gather(("ok", None if to_root else payload))
        self._raise_failures(got)
        if not to_root:
            return [p for _, p in got]
        out: list[Any] | None = [None] * self.size if self.rank == 0 else None
        self._collective(dist.gather_object, payload, out, dst=0, group=self.pg)
        return out

    def report_failure(self, error: BaseException) -> None:
        """Take part in the collective the others are in (a :meth:`gather_ok`) with this process's
        error, so that they raise too. Errors of the collective itself are ignored (the caller
        raises its own)."""
        try:
            self._all_gather(("error", f"{type(error).__name__}: {error}"))
        except BaseException:  # noqa: BLE001 - a peer is gone: nothing more to tell it
            pass

    def _all_gather(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        self._collective(dist.all_gather_object, out, obj, group=self.pg)
        return out

    def _raise_failures(self, got: list) -> None:
        failed = [(r, msg) for r, (status, msg) in enumerate(got) if status != "ok"]
        if failed:
            err = CkptqError(
                f"{len(failed)} of {self.size} processes failed, nothing was committed:\n  "
                + "\n  ".join(f"rank {r}: {msg}" for r, msg in failed)
            )
            err.ckptq_reported = True  # type: ignore[attr-defined]
            raise err

    @staticmethod
    def _collective(fn: Any, *args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except BaseException as e:
            e.ckptq_reported = True  # type: ignore[attr-defined]  # a peer died: no further collectives
            raise


def expect_shared_dir(path: Path, group: Group | None) -> None:
    """On a process other than rank 0: ``path`` (the staging folder rank 0 made before the
    broadcast; a :class:`~pathlib.Path`, other locations are not checked) must be visible here,
    i.e. on a file system every host of the job sees.

    Raises:
        CkptqError: it is not (names the folder, the rank and what to do).
    """
    if group is not None and group.rank != 0 and isinstance(path, Path) and not path.is_dir():
        raise CkptqError(
            f"rank {group.rank} cannot see {path}, the staging folder rank 0 made: with several hosts the "
            f"output must be on a file system every host sees at the same path (a shared file system)"
        )


def prepare_write_commit(
    group: Group | None,
    *,
    prepare: Callable[[], P],
    write: Callable[[P], Any],
    commit: Callable[[P, list[Any]], R],
    abort: Callable[[], None],
    discard: Callable[[P], None],
) -> R:
    """Rank 0 prepares, every process writes, rank 0 commits once all succeeded.

    ``prepare()`` runs on rank 0 (its result, or its error, goes to every process: all raise it);
    ``write(prepared)`` on every process, returning what rank 0 needs from it (picklable);
    ``commit(prepared, parts)`` on rank 0 with every process's part in rank order, once every
    process reported success; its result is returned on every process. When anything fails
    (anywhere): ``abort()`` on every process (drop local state, e.g. close files), then the
    failure is reported to the others (they raise :class:`~ckptq.errors.CkptqError` naming it),
    then ``discard(prepared)`` on rank 0, and the error is raised. With ``group`` None the same
    steps run in this process alone (``commit`` gets ``[part]``).

    Every process must call this with the same ``group`` and in the same order of collectives.
    """
    root = group is None or group.rank == 0
    prepared: Any = None
    if root:
        try:
            prepared = prepare()
        except BaseException as e:
            if group is None:
                raise
            prepared = e
    if group is not None:
        prepared = group.broadcast(prepared)
        if isinstance(prepared, BaseException):
            raise prepared
    try:
        part = write(prepared)
        if group is None:
            return commit(prepared, [part])
        parts = group.gather_ok(part, to_root=True)  # raises on every process if one failed
        result = commit(prepared, parts) if root else None
        group.gather_ok("committed" if root else "ok")
        return group.broadcast(result)
    except BaseException as e:
        abort()
        if group is not None and not getattr(e, "ckptq_reported", False):
            group.report_failure(e)  # the others fail their next collective with this (once done writing)
        if root:
            discard(prepared)
        raise
