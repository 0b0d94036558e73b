"""Planning at 1T scale from metadata alone: open ``.metadata`` and plan one target rank's part.

One command: ``python scripts/bench_plan_scale.py [--curve] [--models] [--json OUT] [--markdown FILE]``.

1. ``build``: a synthetic DCP checkpoint *without tensor bytes*: ``.metadata`` (DCP ``Metadata`` with
   every chunk and storage location, the ckptq record with its digest, pickled as DCP's
   ``FileSystemWriter`` pickles it) and one sparse data file per saving rank (``truncate`` to the
   length the locations need), so every check of ckptq's reader runs, the data-file one included.
   Models: DeepSeek-V3-671B (61 layers, first 3 dense with intermediate 18432, 256 routed experts +
   1 shared, hidden 7168, expert intermediate 2048, MLA: q_lora 1536, kv_lora 512, 128 heads of
   128 + 64 rope dims, v 128; vocab 129280) and Kimi-K2-1T (61 layers, first dense, 384 experts + 1
   shared, 64 heads, vocab 163840). Experts either per expert (2-D ``...experts.linear_fc1.weight{e}``,
   TE GroupedLinear's names) or grouped 3-D (``...experts.linear_fc1.weight`` of (E, 2*inter, hidden)).
   Formats: routed experts NVFP4, shared experts and dense MLPs MXFP8, attention FP8 block 128x128,
   norms, router, embeddings and head bf16. Saved by ``ep * fsdp`` ranks: experts by EP (each
   expert on one EP group) x FSDP2 ``Shard(0)`` of its rows within the group (3-D: ``Shard(0)`` of
   the expert dim over ep, ``Shard(1)`` over fsdp); the other weights by FSDP2 x TP over all
   ranks (column-parallel ``(_StridedShard(0, tp), Shard(0))``, row-parallel ``(Shard(0), Shard(1))``).
2. ``measure``: in a fresh process per measurement, the seconds and peak RSS (``VmHWM`` of that
   process, read at each stage's end; RSS, not tracemalloc) of: importing ckptq's reshard planner,
   opening the checkpoint as ``ckptq reshard`` does (:func:`ckptq.open_checkpoint`: the allow-listed
   unpickle and every check of :mod:`ckptq.io.metadata`), and planning it for another mesh
   (``ep x dp_shard x tp`` with another EP degree and TP; per-expert layouts are stacked into 3-D
   experts, ``--grouped stack``) for one target rank (``plan_reshard(..., ranks=[r])``: the part
   that rank's process writes) or, with ``--whole``, for every rank.

Results: a markdown table on stdout (``--markdown`` appends it to a file) and JSON (``--json``).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = {
    # name: (layers, dense layers, routed experts, heads, vocab, dense intermediate)
    "dsv3-671b": dict(layers=61, dense=3, experts=256, heads=128, vocab=129280, dense_inter=18432),
    "kimi-k2-1t": dict(layers=61, dense=1, experts=384, heads=64, vocab=163840, dense_inter=18432),
}
HIDDEN, MOE_INTER, Q_LORA, KV_LORA, ROPE, NOPE, V_HEAD = 7168, 2048, 1536, 512, 64, 128, 128


def model_tensors(model: str, layers: int | None, grouped: bool):
    """``(fqn, shape, format or None, kind)`` of every weight; kind: ``expert``, ``col``, ``row``
    (TP) or ``rep`` (FSDP only)."""
    m = MODELS[model]
    n_layers = m["layers"] if layers is None else layers
    h, e, heads = HIDDEN, m["experts"], m["heads"]
    yield "model.embed_tokens.weight", (m["vocab"], h), None, "rep"
    yield "lm_head.weight", (m["vocab"], h), None, "col"
    yield "model.norm.weight", (h,), None, "rep"
    for i in range(n_layers):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", (h,), None, "rep"
        yield f"{p}.post_attention_layernorm.weight", (h,), None, "rep"
        a = f"{p}.self_attn"
        yield f"{a}.q_a_proj.weight", (Q_LORA, h), "fp8_block", "rep"
        yield f"{a}.q_a_layernorm.weight", (Q_LORA,), None, "rep"
        yield f"{a}.q_b_proj.weight", (heads * (NOPE + ROPE), Q_LORA), "fp8_block", "col"
        yield f"{a}.kv_a_proj_with_mqa.weight", (KV_LORA + ROPE, h), "fp8_block", "rep"
        yield f"{a}.kv_a_layernorm.weight", (KV_LORA,), None, "rep"
        yield f"{a}.kv_b_proj.weight", (heads * (NOPE + V_HEAD), KV_LORA), "fp8_block", "col"
        yield f"{a}.o_proj.weight", (h, heads * V_HEAD), "fp8_block", "row"
        if i < m["dense"]:
            yield f"{p}.mlp.gate_up_proj.weight", (2 * m["dense_inter"], h), "mxfp8", "col"
            yield f"{p}.mlp.down_proj.weight", (h, m["dense_inter"]), "mxfp8", "row"
            continue
        yield f"{p}.mlp.router.weight", (e, h), None, "rep"
        yield f"{p}.mlp.shared_experts.gate_up_proj.weight", (2 * MOE_INTER, h), "mxfp8", "col"
        yield f"{p}.mlp.shared_experts.down_proj.weight", (h, MOE_INTER), "mxfp8", "row"
        for name, shape in (("linear_fc1", (2 * MOE_INTER, h)), ("linear_fc2", (h, MOE_INTER))):
            if grouped:
                yield f"{p}.mlp.experts.{name}.weight", (e, *shape), "nvfp4", "expert"
            else:
                for j in range(e):
                    yield f"{p}.mlp.experts.{name}.weight{j}", shape, "nvfp4", "expert"


def build(
    path: Path,
    model: str,
    layers: int | None,
    grouped: bool,
    ep: int,
    fsdp: int,
    tp: int,
    *,
    index: bool = True,
    index_only: bool = False,
) -> dict:
    """Write the synthetic checkpoint's ``.metadata`` (with ``index``, the chunk index first, as
    ckptq's writers do; with ``index_only``, the index alone and a stand-in ``.metadata``:
    :func:`_write_index_only`) and sparse data files into ``path``."""
    import functools
    import re

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from ckptq import chunks
    from ckptq.contract import CKPTQ_KEY, make_record, with_digest
    from ckptq.formats import format_class
    from ckptq.formats.base import DESCRIPTOR_VERSION, dtype_to_str
    from ckptq.io.index import write_index
    from ckptq.placement import MeshSpec, rank_boxes

    world = ep * fsdp
    if world % tp:
        raise SystemExit(f"tp={tp} does not divide {world} ranks")
    dense_mesh = MeshSpec(("dp_shard", "tp"), (world // tp, tp))
    expert_mesh = MeshSpec(("ep", "fsdp"), (ep, fsdp))
    fsdp_mesh = MeshSpec(("fsdp",), (fsdp,))
    placements = {
        "col": (_StridedShard(0, split_factor=tp), Shard(0)),
        "row": (Shard(0), Shard(1)),
        "rep": (Shard(0), Replicate()),
    }

    @functools.cache
    def owners(shape: tuple, kind: str) -> tuple:
        """(saving rank, logical box) of each distinct non-empty box."""
        if kind == "expert" and len(shape) == 3:
            boxes = rank_boxes(shape, expert_mesh, (Shard(0), Shard(1)))
        elif kind == "expert":
            boxes = rank_boxes(shape, fsdp_mesh, (Shard(0),))
        else:
            boxes = rank_boxes(shape, dense_mesh, placements[kind] if len(shape) == 2 else placements["rep"])
        out, seen = [], set()
        for r, b in enumerate(boxes):
            if b not in seen and all(b[1]):
                seen.add(b)
                out.append((r, b))
        return tuple(out)

    @functools.cache
    def specs_of(fmt: str, ndim: int):
        cls = format_class(fmt)
        recipe = cls.Recipe()
        return cls, recipe, cls.component_specs((1,) * ndim, recipe)

    import numpy as np

    @functools.cache
    def layout(shape: tuple, kind: str, fmt: str | None) -> tuple:
        """``(format or None, ((key suffix, dtype, global shape, offsets (n, nd), sizes (n, nd), saving
        rank (n,)), ...))``: the chunks of each stored entry of a tensor, per shape (cached)."""
        own = owners(shape, kind)
        if fmt is not None:  # a tensor whose shards cut its blocks is saved in bf16 (as a save would)
            cls, recipe, specs = specs_of(fmt, len(shape))
            align = chunks.alignment(cls.component_specs(shape, recipe), len(shape))
            fmt = fmt if all(chunks.is_aligned(align, shape, b) for _, b in own) else None
        if fmt is None:
            parts = [("", torch.bfloat16, shape, [b for _, b in own], [r for r, _ in own])]
        else:
            parts = []
            for spec in specs:
                seen, boxes, ranks = set(), [], []
                for r, b in own:
                    cbox = chunks.component_box(spec, shape, b)
                    if cbox[0] in seen or not all(cbox[1]):
                        continue
                    seen.add(cbox[0])
                    boxes.append(cbox)
                    ranks.append(r)
                parts.append((f".{spec.name}", spec.dtype, tuple(spec.shape(shape)), boxes, ranks))
        out = []
        for suffix, dtype, gshape, boxes, ranks in parts:
            nd = len(gshape)
            offs = np.array([b[0] for b in boxes], dtype=np.int64).reshape(len(boxes), nd)
            sizes = np.array([b[1] for b in boxes], dtype=np.int64).reshape(len(boxes), nd)
            out.append((suffix, dtype, gshape, offs, sizes, np.array(ranks, dtype=np.int64)))
        return fmt, tuple(out)

    ends = np.zeros(world, dtype=np.int64)
    descriptors: dict = {}
    keys: list = []  # (key, dtype, global shape, offsets, sizes, data file rank, byte offset, length)
    expert_re = re.compile(r"\.weight(\d+)$")
    for fqn, shape, fmt, kind in model_tensors(model, layers, grouped):
        base = 0
        if kind == "expert" and len(shape) == 2:
            e = int(expert_re.search(fqn).group(1))
            per_group = -(-MODELS[model]["experts"] // ep)
            base = (e // per_group) * fsdp
        fmt, parts = layout(shape, kind, fmt)
        comps = {}
        for suffix, dtype, gshape, offs, sizes, ranks in parts:
            key = fqn + suffix
            lengths = sizes.prod(axis=1) * dtype.itemsize if len(sizes) else np.zeros(0, np.int64)
            files = ranks + base
            starts = ends[files]  # one chunk per saving rank within an entry
            np.add.at(ends, files, lengths)
            keys.append((key, dtype, gshape, offs, sizes, files, starts, lengths))
            if fmt is not None:
                comps[suffix[1:]] = {"dtype": dtype_to_str(dtype), "shape": list(gshape), "fqn": key}
        if fmt is not None:
            cls, recipe, _ = specs_of(fmt, len(shape))
            descriptors[fqn] = {
                "format": fmt,
                "version": DESCRIPTOR_VERSION,
                "shape": list(shape),
                "dtype": "bfloat16",
                "recipe": cls._recipe_to_json(recipe),
                "components": comps,
                "mode": "native",
            }
    record = make_record(descriptors, world)
    path.mkdir(parents=True, exist_ok=True)
    n_chunks = sum(len(k[3]) for k in keys)
    if index_only:
        _write_index_only(path, keys, record, world, n_chunks)
    else:
        sdm, storage = {}, {}
        size_cache: dict = {}
        for key, dtype, gshape, offs, sizes, files, starts, lengths in keys:
            md = sdm[key] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(gshape), [])
            for i, (o, z, f, st, n) in enumerate(
                zip(offs.tolist(), sizes.tolist(), files.tolist(), starts.tolist(), lengths.tolist(), strict=True)
            ):
                of = size_cache.setdefault(tuple(o), torch.Size(o))
                sz = size_cache.setdefault(tuple(z), torch.Size(z))
                md.chunks.append(ChunkStorageMetadata(of, sz))
                storage[MetadataIndex(key, of, i)] = _StorageInfo(f"__{f}_0.distcp", st, n)
        md = Metadata(sdm, planner_data={CKPTQ_KEY: record}, storage_data=storage)
        with_digest(md)
        if index:
            write_index(path, md)  # as ckptq's writers do, before .metadata (which names it)
        with open(path / ".metadata", "wb") as f:
            pickle.dump(md, f)  # as torch's FileSystemWriter.finish
    for r, end in enumerate(ends.tolist()):
        with open(path / f"__{r}_0.distcp", "wb") as f:
            f.truncate(end)  # sparse: the lengths are what the reader checks
    tensors = list(model_tensors(model, layers, grouped))
    return {
        "model": model,
        "layers": layers or MODELS[model]["layers"],
        "experts": "grouped 3-D" if grouped else "per expert 2-D",
        "savers": f"ep={ep},fsdp={fsdp} (tp={tp} for dense)",
        "saving_ranks": world,
        "entries": len(keys),
        "logical_tensors": len(tensors),
        "saved_chunks": n_chunks,
        "params": sum(_numel(s) for _, s, _, _ in tensors),
        "metadata_mib": os.path.getsize(path / ".metadata") / 2**20,
        "metadata_real": not index_only,
        "index_mib": os.path.getsize(path / ".metadata.index") / 2**20 if (path / ".metadata.index").exists() else None,
        "checkpoint_gib": float(ends.sum()) / 2**30,
    }


#: Bytes of DCP's pickled ``.metadata`` per saved chunk in these layouts (the curve 10^6 case: 112
#: MiB for 888,808 chunks), for the stand-in ``.metadata`` of an index-only build.
METADATA_BYTES_PER_CHUNK = 132


def _write_index_only(path: Path, keys: list, record: dict, world: int, n_chunks: int) -> None:
    """The chunk index written directly from the chunk arrays (numpy; no Python object per chunk),
    and a stand-in ``.metadata``: a pickled ``Metadata`` holding only the ckptq record that names
    the index, zero-padded (sparse) to the size DCP's would have (:data:`METADATA_BYTES_PER_CHUNK`),
    so that the index reader's scan of ``.metadata`` for the index's digest reads as many bytes.
    No full reader can open it (its entries are not there): index-path measurements only."""
    import numpy as np
    from torch.distributed.checkpoint.metadata import Metadata

    from ckptq.contract import CKPTQ_KEY, with_index
    from ckptq.io.index import INDEX_FILE, encode_planner_data, pack_index, save_index

    keys = sorted(keys, key=lambda k: k[0])  # by name, as ckptq's writers write it
    maxnd = max(len(k[2]) for k in keys)
    dtypes: dict = {}
    ent, names, blocks = [], [], []
    row = 0
    for key, dtype, gshape, offs, sizes, files, starts, lengths in keys:
        nd, n = len(gshape), len(offs)
        # an entry's rows sorted by offsets, then sizes, as ckptq's writers sort them (ckptq.io.index)
        if nd:
            last_first = reversed(range(nd))
            order = np.lexsort([*(sizes[:, d] for d in reversed(range(nd))), *(offs[:, d] for d in last_first)])
            offs, sizes, files, starts, lengths = (a[order] for a in (offs, sizes, files, starts, lengths))
        code = dtypes.setdefault(str(dtype).removeprefix("torch."), len(dtypes))
        ent.append([0, code, nd, row, n, *gshape, *[1] * (maxnd - nd)])
        names.append(key.encode())
        b = np.zeros((n, 2 * maxnd + 4), dtype=np.int64)
        b[:, maxnd : 2 * maxnd] = 1  # padded sizes
        b[:, :nd], b[:, maxnd : maxnd + nd] = offs, sizes
        b[:, 2 * maxnd], b[:, 2 * maxnd + 1], b[:, 2 * maxnd + 2], b[:, 2 * maxnd + 3] = files, starts, lengths, -1
        blocks.append(b)
        row += n
    doc = {
        "dtypes": list(dtypes),
        "files": [f"__{r}_0.distcp" for r in range(world)],
        **encode_planner_data(record, {}),
        "version": None,
        "checksums": False,
    }
    tensors, header = pack_index(np.array(ent, dtype=np.int64), names, np.concatenate(blocks), doc)
    save_index(path, tensors, header)
    stub = Metadata({}, planner_data=with_index({CKPTQ_KEY: record}, INDEX_FILE, header["tables_sha256"]))
    with open(path / ".metadata", "wb") as f:
        pickle.dump(stub, f)
        f.truncate(max(f.tell(), n_chunks * METADATA_BYTES_PER_CHUNK))


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# What runs in the measured process: times and VmHWM at each stage's end.
MEASURE = r"""
import json, sys, time
t0, c0 = time.perf_counter(), time.process_time()
def hwm():
    return [int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM:')][0] / 1024
def stage(name, t, c):
    out[name + "_s"], out[name + "_cpu_s"], out[name + "_mib"] = time.perf_counter() - t, time.process_time() - c, hwm()
    return time.perf_counter(), time.process_time()
sys.path.insert(0, {root!r})
from ckptq.checkpoint import open_checkpoint, open_indexed
from ckptq.placement import MeshSpec, PlacementRules
from ckptq.parse import parse_placement
from ckptq.reshard import plan_reshard
out = {{}}
t, c = stage("import", t0, c0)
view = open_indexed({path!r}) if {indexed!r} else open_checkpoint({path!r})
assert not {indexed!r} or view is not None, "no index"
t, c = stage("open", t, c)
mesh = MeshSpec(("ep", "dp_shard", "tp"), {mesh!r})
P = lambda *s: [parse_placement(x) for x in s]
rules = PlacementRules(mesh, "file", {{
    "*.experts.*": P("S(0)", "S(1)", "R"),
    "*.gate_up_proj.weight": P("S(0)", "S(0)", "S(0)"), "*.q_b_proj.weight": P("S(0)", "S(0)", "S(0)"),
    "*.kv_b_proj.weight": P("S(0)", "S(0)", "S(0)"), "lm_head.weight": P("S(0)", "S(0)", "S(0)"),
    "*.o_proj.weight": P("S(0)", "S(0)", "S(1)"), "*.down_proj.weight": P("S(0)", "S(0)", "S(1)"),
    "*": P("S(0)", "S(0)", "R"),
}})
kw = {{"grouped": "stack", "grouped_glob": "*.experts.*"}} if {stack!r} else {{}}
if {to!r}:
    kw["to"] = {to!r}
if {share!r}:  # process p of P: the target ranks it writes under torchrun
    from ckptq.distributed import file_share
    ranks, part, parts = file_share(mesh.world_size, {share!r}[1], {share!r}[0])
    kw["ranks"] = ranks
elif {ranks!r} is not None:
    kw["ranks"] = {ranks!r}
plan = plan_reshard(view, mesh, rules, **kw)
t, c = stage("plan", t, c)
if {indexed!r} and not {share!r}:  # the chunk rows of what the planned ranks read (a full open checks them all)
    wanted = {{}}
    for j in plan.jobs:
        for k, boxes in j.source_boxes().items():
            wanted[k] = None if boxes is None or wanted.get(k, []) is None else wanted.get(k, []) + boxes
    view.need(wanted)
    keys = wanted
    sdm = view.metadata.state_dict_metadata
    out["rows_keys"], out["rows_chunks"] = len(keys), sum(len(getattr(sdm[k], "chunks", ())) for k in keys)
    out["rows_read"] = sum(len(view._rows[k]) for k in keys if k in view._rows)
    t, c = stage("rows", t, c)
if {share!r}:  # what run_reshard does next: lay out its files, decide copied / computed, its summary for the others
    import pickle
    import ckptq.reshard.run as run
    # the synthetic data files hold no records: the record headers a copied job's chunks are
    # located by are not read (its rows are: stage rows); the rest of the copy decision runs
    run.CheckpointView.saved_chunks = lambda self, key: [] if key in self._rows else None
    work, summary = run._lay_out(view, plan, ranks, part, parts)
    out["layout_records"] = sum(len(outs) for _, outs, _ in work)
    out["summary_bytes"], out["transformed_here"] = len(pickle.dumps(summary)), len(summary[1])
    out["rows_entries"], out["rows_read"] = len(view._rows), sum(len(r) for r in view._rows.values())
    out["chunks_made"] = int(sum(m.sum() for m in view._made.values()))
    t, c = stage("layout", t, c)
out.update(total_s=time.perf_counter() - t0, total_cpu_s=time.process_time() - c0)
per_rank = plan.bytes_per_rank()
out.update(jobs=len(plan.jobs), boxes=sum(len(j.owners) for j in plan.jobs), problems=len(plan.problems),
           target_ranks=mesh.world_size, planned_bytes=sum(per_rank.values()))
print(json.dumps(out))
"""


def measure(
    path: Path,
    mesh: tuple,
    stack: bool,
    ranks: list[int] | None,
    env: dict,
    root=ROOT,
    indexed: bool = False,
    share: tuple[int, int] | None = None,
    to: str | None = None,
) -> dict:
    """One fresh process: import, open, plan (wall and CPU seconds, ``VmHWM`` MiB after each);
    ``indexed``: open from the chunk index (``open_indexed``) and, after planning, read and check
    the chunk rows of the entries the plan reads (stage ``rows``); ``share`` ``(p, P)``: plan the
    target ranks process p of P writes under torchrun (``ckptq.distributed.file_share``) and lay
    its files out as ``run_reshard`` does before writing (stage ``layout``); ``to``: convert."""
    code = MEASURE.format(
        root=str(root), path=str(path), mesh=tuple(mesh), stack=stack, ranks=ranks, indexed=indexed, share=share, to=to
    )
    t0 = time.perf_counter()
    cmd = [sys.executable, "-c", code]
    if os.environ.get("BENCH_ONE_CORE", "1") == "1" and hasattr(os, "sched_getaffinity"):
        cmd = ["taskset", "-c", str(min(os.sched_getaffinity(0))), *cmd]  # one core
    proc = subprocess.run(cmd, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["wall_s"] = time.perf_counter() - t0
    return out


#: (name, label, model, layers (None: all), grouped 3-D experts, saving ep, fsdp, tp, target (ep, dp_shard, tp))
CASES = [
    ("dsv3-p", "DeepSeek-V3-671B, per-expert", "dsv3-671b", None, False, 64, 16, 8, (32, 32, 2)),
    ("dsv3-g", "DeepSeek-V3-671B, grouped 3-D", "dsv3-671b", None, True, 64, 16, 8, (32, 32, 2)),
    ("kimi-p", "Kimi-K2-1T, per-expert", "kimi-k2-1t", None, False, 128, 16, 8, (64, 32, 2)),
    ("kimi-g", "Kimi-K2-1T, grouped 3-D", "kimi-k2-1t", None, True, 128, 32, 8, (64, 32, 2)),
    # Kimi-K2-1T saved by 1024 ranks: fits a 4-minute run (the 2048 / 4096-rank ones take longer)
    ("kimi-p1k", "Kimi-K2-1T, per-expert", "kimi-k2-1t", None, False, 64, 16, 8, (32, 32, 2)),
    ("kimi-g1k", "Kimi-K2-1T, grouped 3-D", "kimi-k2-1t", None, True, 64, 16, 8, (32, 32, 2)),
    # the cost curve: DeepSeek-V3 shapes, per-expert tensors, fewer layers / saving ranks
    ("1e4", "curve 10^4", "dsv3-671b", 4, False, 8, 4, 2, (4, 4, 1)),
    ("1e5", "curve 10^5", "dsv3-671b", 8, False, 32, 8, 4, (16, 8, 2)),
    ("1e6", "curve 10^6", "dsv3-671b", 20, False, 64, 32, 8, (32, 32, 4)),
    ("1e7", "curve 10^7", "dsv3-671b", 61, False, 128, 64, 8, (64, 64, 4)),
]
MODEL_CASES = ("dsv3-p", "dsv3-g", "kimi-p", "kimi-g")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=None, help="keep the synthetic checkpoints here (reused when present)")
    ap.add_argument("--models", action="store_true", help="the 671B / 1T rows")
    ap.add_argument("--curve", default="", help="comma list of curve points 1e4,1e5,1e6,1e7 (fewer layers / ranks)")
    ap.add_argument("--case", default="", help="comma list of cases by name (CASES: dsv3-p, kimi-g1k, 1e4, ...)")
    ap.add_argument("--before", default=None, help="a directory holding another ckptq package to measure too")
    ap.add_argument("--whole", action="store_true", help="also plan every target rank (the old cost)")
    ap.add_argument("--rank", type=int, default=None, help="the target rank planned (default: the middle one)")
    ap.add_argument("--index", action="store_true", help="also open and plan from the chunk index (open_indexed)")
    ap.add_argument(
        "--index-only",
        default="",
        help="comma list of cases built as the chunk index alone (numpy, fast; a stand-in .metadata): "
        "only the index path is measured",
    )
    ap.add_argument(
        "--processes",
        default="",
        help="comma list of process counts P: also measure process P/2 of P under torchrun (its target "
        "ranks planned and laid out, from the index)",
    )
    ap.add_argument("--to", default=None, help="with --processes: convert to this format (transformed jobs)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", default=None)
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ckptq-planscale-"))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    cases = [c for c in CASES if (args.models and c[0] in MODEL_CASES) or c[0] in args.curve.split(",")]
    only = set(filter(None, args.index_only.split(",")))
    cases += [c for c in CASES if c[0] in args.case.split(",") + list(only) and c not in cases]
    results = []
    for name, label, model, layers, grouped, ep, fsdp, tp, target in cases:
        index_only = name in only
        d = work / f"{model}-{layers}-{'g' if grouped else 'p'}-{ep}x{fsdp}x{tp}{'-index' if index_only else ''}"
        info_file = d / "info.json"
        if not info_file.is_file():
            t0 = time.perf_counter()
            info = build(d, model, layers, grouped, ep, fsdp, tp, index_only=index_only)
            info["build_s"] = time.perf_counter() - t0
            info_file.write_text(json.dumps(info))
        info = json.loads(info_file.read_text())
        world = target[0] * target[1] * target[2]
        rank = args.rank if args.rank is not None else world // 2 + 1
        row = {"label": label, **info, "target_mesh": f"ep={target[0]},dp_shard={target[1]},tp={target[2]}"}
        if args.index or index_only:
            row["indexed"] = measure(d, target, not grouped, [rank], env, indexed=True)
            row["indexed"]["rank"] = rank
        for n in filter(None, args.processes.split(",")):
            share = (int(n) // 2, int(n))
            row[f"process-{n}"] = measure(d, target, not grouped, None, env, indexed=True, share=share, to=args.to)
            print(json.dumps({n: row[f"process-{n}"]}), file=sys.stderr)
        if index_only:
            results.append(row)
            print(json.dumps(row), file=sys.stderr)
            continue
        row["one_rank"] = measure(d, target, not grouped, [rank], env)
        row["one_rank"]["rank"] = rank
        if args.whole:
            row["whole"] = measure(d, target, not grouped, None, env)
        if args.before:
            before_env = {**env, "PYTHONPATH": str(Path(args.before).absolute())}
            row["before"] = measure(d, target, not grouped, None, before_env, root=args.before)
        results.append(row)
        print(json.dumps(row), file=sys.stderr)
    machine = f"{platform.node()}: {os.cpu_count()} CPU cores, Python {platform.python_version()}"
    import torch

    lines = [
        f"Measured {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, {machine}, torch {torch.__version__}. "
        "Each cell: wall seconds (CPU seconds) / peak RSS MiB (`VmHWM` of the measuring process at the end of "
        "the stage; it includes the stages before).",
        "",
        "| checkpoint | saved chunks | `.metadata` MiB | planned for | import | open `.metadata` | plan one rank "
        "| total | whole plan (every rank) | before: open + whole plan |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(m: dict | None, stage: str) -> str:
        if not m:
            return ""
        return f"{m[stage + '_s']:.2f} ({m[stage + '_cpu_s']:.2f}) / {m[stage + '_mib']:.0f}"

    for r in results:
        if "one_rank" not in r:
            continue
        o = r["one_rank"]
        w, before = r.get("whole"), r.get("before")
        lines.append(
            f"| {r['label']} ({r['params'] / 1e9:.0f}B params, {r['logical_tensors']:,} tensors, saved by "
            f"{r['saving_ranks']} ranks) | {r['saved_chunks']:,} | {r['metadata_mib']:.0f} | {r['target_mesh']}, "
            f"rank {o['rank']} ({o['jobs']:,} jobs, {o['boxes']:,} boxes) | {cell(o, 'import')} | {cell(o, 'open')} "
            f"| {cell(o, 'plan')} | {o['total_s']:.2f} ({o['total_cpu_s']:.2f}) / {o['plan_mib']:.0f} "
            f"| {cell(w, 'plan')} | "
            + (f"{before['total_s']:.2f} ({before['total_cpu_s']:.2f}) / {before['plan_mib']:.0f} |" if before else "|")
        )
    indexed = [r for r in results if "indexed" in r]
    if indexed:
        lines += [
            "",
            "From the chunk index (`open_indexed`; one core). Each cell: CPU seconds (wall) / `VmHWM` MiB at the "
            "stage's end. *index only*: built as the index alone (numpy) with a stand-in `.metadata` of DCP's "
            f"size ({METADATA_BYTES_PER_CHUNK} B per chunk, sparse) that the reader scans for the index's digest.",
            "",
            "| checkpoint | saved chunks | index MiB | planned for | import | open index | plan one rank "
            "| read + check its chunk rows | open + plan + rows | per saved chunk |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in indexed:
            m = r["indexed"]

            def c2(stage: str, m=m) -> str:
                return f"{m[stage + '_cpu_s']:.2f} ({m[stage + '_s']:.2f}) / {m[stage + '_mib']:.0f}"

            work_cpu = m["open_cpu_s"] + m["plan_cpu_s"] + m["rows_cpu_s"]
            work_wall = m["open_s"] + m["plan_s"] + m["rows_s"]
            lines.append(
                f"| {r['label']}{'' if r.get('metadata_real', True) else ' (index only)'} "
                f"({r['logical_tensors']:,} tensors, saved by {r['saving_ranks']} ranks) | {r['saved_chunks']:,} "
                f"| {r['index_mib']:.0f} | {r['target_mesh']}, rank {m['rank']} ({m['jobs']:,} jobs) | {c2('import')} "
                f"| {c2('open')} | {c2('plan')} | {c2('rows')} ({m['rows_read']:,} rows of {m['rows_keys']:,} entries "
                f"checked, {m['rows_chunks']:,} chunks made) | {work_cpu:.2f} ({work_wall:.2f}) / {m['rows_mib']:.0f} "
                f"| {work_cpu / r['saved_chunks'] * 1e6:.2f} us |"
            )
    text = "\n".join(lines)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "machine": machine}, indent=1))
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
