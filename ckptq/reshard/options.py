"""The options of ``ckptq reshard`` / ``ckptq convert`` as one object, and the one call that runs them.

``ckptq convert SRC DST --to X`` is ``ckptq reshard`` with ``to``: :func:`reshard_checkpoint` parses
a :class:`ReshardOptions` (option text as the CLI spells it, or library values), opens the source,
plans (:func:`~ckptq.reshard.plan.plan_reshard`) and, unless ``dry_run``, writes
(:func:`~ckptq.reshard.run.run_reshard`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence

import torch

from .. import parse
from ..checkpoint import open_checkpoint, open_indexed
from ..contract import MODES, NATIVE
from ..distributed import file_share, process_rank_size
from ..errors import UsageError
from ..parse import HP_DTYPES
from ..placement import MeshSpec, PlacementRules
from .plan import GROUPED, MISALIGNED, plan_reshard
from .run import run_reshard

__all__ = ["ReshardOptions", "reshard_checkpoint"]

_RECIPE_OPTIONS = ("block", "two_d", "columnwise", "fp8_dtype", "pow2", "scale_rule")


def _spelled(choices: Sequence[str]) -> tuple[str, ...]:
    """Choices as the CLI spells them (``high-precision``)."""
    return tuple(c.replace("_", "-") for c in choices)


@dataclasses.dataclass(frozen=True)
class ReshardOptions:
    """What ``ckptq reshard`` and ``ckptq convert`` take (the CLI builds one from its flags).

    Attributes:
        mesh: target mesh, ``"dp_shard=4,tp=2"``, ``"8"`` or a :class:`~ckptq.placement.MeshSpec`.
        plan: the placement rules (the CLI's ``--plan``): a preset (``replicate``, ``fsdp2``,
            ``fsdp2-tp``), a JSON/YAML file of FQN glob -> placements, or a
            :class:`~ckptq.placement.PlacementRules`; ``rules``: fsdp2-tp ``GLOB=col|row`` strings.
        allow_unmatched: a rule glob that matches no tensor of the source is listed in the summary's
            ``unmatched_rules`` instead of raising :class:`~ckptq.errors.UsageError`.
        mode: ``None`` (keep), ``"native"`` or ``"high-precision"`` for every quantized tensor.
        dtype: storage dtype of high-precision output (``bfloat16``, ``float16``, ``float32``).
        grouped: ``"stack"`` / ``"split"`` grouped weights whose stems match ``grouped_glob``.
        to: convert every quantized tensor: ``native`` (natively in its own format, e.g. a
            TransformerEngine checkpoint's tensors as ckptq components), ``nvfp4``, ``mxfp4``, ``mxfp8``,
            ``fp8_block``, ``fp8_tensor``, or ``bfloat16``/``float16``/``float32`` (dequantized;
            then also the dtype of ``misaligned`` output). Not with ``mode``.
        block, two_d, columnwise, fp8_dtype, pow2, scale_rule: recipe options of a format ``to``
            (``None``: its default); ``block`` ``"1x128"``, ``fp8_dtype`` ``"e4m3"``/``"e5m2"``,
            ``scale_rule`` (mxfp4) ``"floor"``/``"even"``/``"ceil"``/``"rceil"``.
        misaligned: ``"error"`` or ``"high-precision"`` (export tensors whose cuts split blocks).
        overwrite: replace an existing destination. dry_run: plan only, write nothing.
        progress: ``True`` for a tqdm bar on stderr (bytes and bytes/s; rank 0's share when
            distributed), or a callable given the bytes of each chunk written.
        distributed: split the writing over the processes of a ``torch.distributed`` job (every
            process calls with the same options; see :func:`~ckptq.reshard.run.run_reshard`).
            ``ckptq reshard|convert`` set it when started by ``torchrun`` with more than one process;
            each requantized tensor is computed by one process.
        device: where re-encoding and dequantizing run: ``"auto"`` (a CUDA device when one is there
            and ckptq's CUDA kernels are built, else the CPU), ``"cpu"``, ``"cuda"``, ``"cuda:N"``
            (the CLI's ``--device``; :func:`ckptq.io.device.resolve_device`). The same bytes either way.
        index: open the source from its chunk index when it has a valid one (the default;
            :func:`ckptq.checkpoint.open_indexed`: no unpickling of ``.metadata``; an entry's chunk rows
            are read and checked when it is read), else through ``.metadata``; a damaged index is a
            :class:`~ckptq.errors.CheckpointFormatError`. ``False``: always through ``.metadata``. The
            same bytes either way. ``distributed``: each process plans only the target ranks it
            writes (:func:`ckptq.distributed.file_share`).
    """

    mesh: str | MeshSpec = "1"
    plan: str | PlacementRules = "fsdp2"
    rules: Sequence[str] = ()
    allow_unmatched: bool = False
    mode: str | None = None
    dtype: str | torch.dtype = "bfloat16"
    grouped: str | None = None
    grouped_glob: str = "*weight"
    to: str | None = None
    block: str | tuple[int, int] | None = None
    two_d: bool | None = None
    columnwise: bool | None = None
    fp8_dtype: str | torch.dtype | None = None
    pow2: bool | None = None
    scale_rule: str | None = None
    misaligned: str = "error"
    overwrite: bool = False
    dry_run: bool = False
    progress: bool | Callable[[int], None] | None = None
    distributed: bool = False
    device: str | torch.device | None = "auto"
    index: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", tuple(self.rules or ()))

    def planning(self) -> dict:
        """The keyword arguments of :func:`~ckptq.reshard.plan.plan_reshard` (library spellings).

        Raises:
            UsageError: option text that does not parse, ``to`` with ``mode``, recipe options
                without a format ``to`` or that it does not take.
        """
        recipe = {k: getattr(self, k) for k in _RECIPE_OPTIONS}
        if self.to is None:
            if any(v is not None for v in recipe.values()):
                raise UsageError(
                    "--block, --two-d, --columnwise, --fp8-dtype, --pow2 and --scale-rule are recipe options "
                    "of --to FORMAT"
                )
            options = dict(
                mode=parse.parse_choice("--mode", self.mode, _spelled(MODES)), hp_dtype=parse.parse_hp_dtype(self.dtype)
            )
        else:
            if self.mode is not None:
                raise UsageError(f"--to {self.to} and --mode {self.mode}: give one of them")
            to = parse.parse_target(self.to)
            to_recipe = parse.parse_recipe(to, **recipe)
            hp_dtype = HP_DTYPES[to] if to in HP_DTYPES else parse.parse_hp_dtype(self.dtype)
            if to == NATIVE:  # every quantized tensor natively in its own format
                options = dict(mode=NATIVE, hp_dtype=hp_dtype)
            else:
                options = dict(to=to, to_recipe=to_recipe, hp_dtype=hp_dtype)
        return dict(
            options,
            grouped=parse.parse_choice("--grouped", self.grouped, GROUPED),
            grouped_glob=self.grouped_glob,
            misaligned=parse.parse_choice("--misaligned", self.misaligned, _spelled(MISALIGNED)),
        )


def reshard_checkpoint(
    src: str | os.PathLike, dst: str | os.PathLike, options: ReshardOptions | None = None, **fields
) -> dict:
    """Lay checkpoint ``src`` out for a target mesh in ``dst``, converting its tensors if asked
    (``ckptq reshard`` and ``ckptq convert``): plan, then write.

    Args:
        options: a :class:`ReshardOptions`; ``fields``: any of its fields, given or overriding
            (``reshard_checkpoint(src, dst, mesh="2", to="nvfp4")``).

    Returns:
        ``{"plan": ReshardPlan.summary()}`` and, unless ``dry_run``, the keys of
        :func:`~ckptq.reshard.run.run_reshard`'s report.

    Raises:
        UsageError: option text that does not parse (:meth:`ReshardOptions.planning`), or a
            ``--rule`` glob that matches no tensor (:func:`ckptq.parse.check_rules`).
        ShardingError: misaligned tensors (nothing is written). CkptqError: ``dst`` exists or
        overlaps ``src``; see :func:`~ckptq.reshard.plan.plan_reshard`.
    """
    o = dataclasses.replace(options, **fields) if options is not None else ReshardOptions(**fields)
    planning = o.planning()
    mesh = parse.parse_mesh(o.mesh)
    placement_rules = parse.parse_placement_rules(mesh, o.plan, o.rules)
    view = (open_indexed(src) if o.index else None) or open_checkpoint(src)
    unmatched = parse.check_rules(placement_rules, [e.fqn for e in view.entries()], allow_unmatched=o.allow_unmatched)
    ranks = None
    if o.distributed and not o.dry_run:  # this process's target ranks only
        rank, processes = process_rank_size()
        ranks = file_share(mesh.world_size, processes, rank)[0]
    plan = plan_reshard(view, mesh, placement_rules, ranks=ranks, **planning)
    if o.dry_run:
        return {"plan": {**plan.summary(), "unmatched_rules": unmatched}}
    report = run_reshard(
        view, plan, dst, overwrite=o.overwrite, progress=o.progress, distributed=o.distributed, device=o.device
    )
    return {**report, "plan": {**report["plan"], "unmatched_rules": unmatched}}
