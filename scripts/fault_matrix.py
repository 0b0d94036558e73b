"""Faults during ckptq's writes, at random moments, under torchrun with gloo: the fault table.

One command: ``python scripts/fault_matrix.py [--trials 2] [--seed 0] [--ranks 2 4] [--ops ...]
[--faults ...] [--json F] [--md F]``.

Every trial overwrites a destination that holds a whole *old* output with a *new* one, by one
operation -- ``save`` (``dcp.save`` with :class:`ckptq.io.AtomicFileSystemWriter` and
:class:`ckptq.QuantizedSavePlanner`), ``async_save`` (``dcp.async_save`` with the same writer and
planner: each rank polls the future while DCP's background thread writes, then takes its
``result()``), ``ckptq reshard``, ``ckptq convert --to nvfp4`` (each
``python -m torch.distributed.run --standalone --nproc-per-node N``, gloo) or ``ckptq export``
(compressed-tensors safetensors; one process: export does not split its work over processes) --
while one fault strikes:

- ``kill``: SIGKILL of one rank (chosen at random) at a random moment after its staging folder
  appeared (uniform over the operation's measured duration). Expected: the destination is the old
  output or, if the kill came after the commit, the new one, whole (``ckptq verify`` integrity +
  bit-exact against a reference); a killed run's staging folder is removed by the next run.
- ``full``: the disk fills (``RLIMIT_FSIZE`` of every rank, a random fraction of the largest output
  file; Python ignores SIGXFSZ, so the write fails with EFBIG). Expected: the job fails with an
  error naming the destination and the cause, the old output is unchanged, no staging folder left.
- ``enospc``: the file system is really full: the destination's folder is a tmpfs holding the old
  output and room for a random 5-90 % of the new one, mounted in a private mount namespace
  (``unshare -m`` as root, an unprivileged user namespace ``unshare -rm`` otherwise; the rows are
  skipped, with the reason, where neither may mount). Expected: as ``full``, the cause ENOSPC.
- ``readonly``: the destination's folder is read-only (when this script runs as root, the job runs
  under ``setpriv`` without the capabilities that bypass file permissions). Expected: a clear error, nothing
  changed, nothing left.
  For ``async_save`` the error must come out of the future's ``result()`` as a ``CkptqError``.
- ``reader``: a second process loads the destination over and over while it is overwritten (DCP
  outputs: ``dcp.load`` with :class:`ckptq.io.SafeFileSystemReader`; exports: ``safetensors``'
  ``load_file`` of every shard listed in the index). Expected: every load gives exactly the old or
  the new tensors (bytes compared), never a mix, never an error.

The result is JSON (per fault x operation x ranks: trials, passed, failures with their reasons) and
a markdown table (``--md``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OPS = ("save", "async_save", "reshard", "convert", "export")
FAULTS = ("kill", "full", "enospc", "readonly", "reader")
_BYPASS = ("dac_override", "dac_read_search", "fowner", "linux_immutable")
SHARD = "300KB"  # exports in several shards, so that a reader could mix shards of two exports
RESHARD_ARGS = ["--mesh", "dp_shard=2,tp=2", "--plan", "fsdp2-tp"]


# ---------------------------------------------------------------------------- what the jobs run
def _save_child(sd_path: str, dst: str, mode: str) -> None:
    """One rank of the ``save`` / ``async_save`` operation (run by torchrun through ``--child-save``).
    ``async_save``: the rank polls the future (as a training loop would) while DCP's background
    thread writes, then takes its result; a failure there is re-raised as the ckptq error inside
    DCP's ``CheckpointException`` (:func:`ckptq.io.dcp_failure`)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    import ckptq
    from ckptq.io import AtomicFileSystemWriter, dcp_failure

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    try:
        sd = torch.load(sd_path, weights_only=False)
        writer, planner = AtomicFileSystemWriter(dst), ckptq.QuantizedSavePlanner()
        if mode == "save":
            dcp.save(sd, storage_writer=writer, planner=planner)
            return
        future = dcp.async_save(sd, storage_writer=writer, planner=planner)
        while not future.done():
            time.sleep(0.005)
        try:
            future.result()
        except CheckpointException as e:
            err = dcp_failure(e, dst)
            print(f"[rank{dist.get_rank()}]: async_save's future.result() raised {type(err).__name__}: {err}")
            raise err from None
    finally:
        dist.destroy_process_group()


def _command(op: str, ranks: int, src: Path, dst: Path, sd: Path) -> list[str]:
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    if op in ("save", "async_save"):
        return run + [str(Path(__file__).resolve()), "--child-save", str(sd), str(dst), op]
    if op == "export":  # one process
        return [sys.executable, "-m", "ckptq", "export", str(src), str(dst), "--layout", "compressed-tensors",
                "--no-model-config", "--max-shard-size", SHARD, "--overwrite"]  # fmt: skip
    extra = RESHARD_ARGS if op == "reshard" else ["--to", "nvfp4"]
    return run + ["-m", "ckptq", op, str(src), str(dst), *extra, "--overwrite"]


def _env() -> dict:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "CKPTQ_DISABLE_PROGRESS_BARS": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONWARNINGS": "ignore",
    }


def _launch(cmd: list[str], *, fsize: int | None = None, unprivileged: bool = False) -> subprocess.Popen:
    def pre() -> None:
        os.setsid()
        if fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    if unprivileged:  # root without the capabilities that bypass file permissions
        cmd = ["setpriv", "--inh-caps=-all", f"--bounding-set=-{',-'.join(_BYPASS)}", *cmd]
    return subprocess.Popen(
        cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=pre, cwd="/"
    )


def mount_namespace() -> tuple[list[str] | None, str]:
    """The command prefix that runs a command in a private mount namespace in which it may mount a
    small tmpfs (:func:`mount_tmpfs`; the mounts vanish with the namespace): ``unshare -m`` as
    root, else (or where root lacks the capability, as in a container) ``unshare -rm``, an
    unprivileged user namespace. ``(None, why)`` where neither works (no ``unshare``, user
    namespaces disabled, a container that forbids both)."""
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return None, "no unshare(1) or mount(8) on this system"
    why = []
    for prefix in (["unshare", "-m"], ["unshare", "-rm"]) if os.geteuid() == 0 else (["unshare", "-rm"],):
        probe = [*prefix, "mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", tempfile.gettempdir()]
        out = subprocess.run(probe, capture_output=True, text=True)
        if out.returncode == 0:
            return prefix, ""
        why.append(f"`{' '.join(prefix)}` cannot mount a tmpfs here: {(out.stderr or out.stdout).strip()[:200]}")
    return None, "; ".join(why)


def mount_tmpfs(path: Path, size: int, *, remount: bool = False) -> None:
    """Mount a tmpfs of ``size`` bytes (rounded up to pages) at ``path``, or resize the one there
    (inside :func:`mount_namespace`'s namespace). A write past its size fails with ENOSPC."""
    opts = f"remount,size={size}" if remount else f"size={size}"
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], check=True, capture_output=True)


def _enospc_child(spec_path: str) -> None:
    """One ``enospc`` trial, inside a private mount namespace (``--child-enospc``): a tmpfs at
    ``mount`` holding the old output at ``dst`` and free space for ``frac`` of another output of
    its size; the operation overwrites it; prints the outcome (JSON) as its last line."""
    spec = json.loads(Path(spec_path).read_text())
    m = Path(spec["mount"])
    mount_tmpfs(m, 256 << 20)
    dst = m / "dst"
    shutil.copytree(spec["old"], dst)
    used = shutil.disk_usage(m).used
    size = used + int(spec["frac"] * used)  # the new output is about as large as the old one
    mount_tmpfs(m, size, remount=True)
    cmd = _command(spec["op"], spec["ranks"], Path(spec["src"]), dst, Path(spec["sd"]))
    rc, out = _finish(_launch(cmd))
    info = {"fs_bytes": size, "old_bytes": used, "rc": rc, "dst": _whole(dst, spec["refs"]), "left": _leftovers(dst)}
    print(json.dumps({"rc": rc, "out": out[-20000:], "info": info}))


# ---------------------------------------------------------------------------- checking outputs
def _state(seed: int):
    import torch

    import ckptq

    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i in range(6):
        sd[f"model.layers.{i}.mlp.up_proj.weight"] = ckptq.quantize(torch.randn(256, 256, generator=g) * 0.02, "mxfp8")
        sd[f"model.layers.{i}.mlp.down_proj.weight"] = ckptq.quantize(torch.randn(256, 256, generator=g), "mxfp8")
        sd[f"model.layers.{i}.input_layernorm.weight"] = torch.randn(256, generator=g)
    return sd


def _is_dcp(p: Path) -> bool:
    return (p / ".metadata").is_file()


def digest(path: Path) -> str:
    """A hash of every tensor of the checkpoint or export at ``path``, as a reader loads them:
    DCP outputs with ``dcp.load`` + :class:`~ckptq.io.SafeFileSystemReader` (raw entries),
    safetensors folders with ``safetensors.torch.load_file`` of every shard the index lists."""
    import torch

    h = hashlib.sha256()
    if _is_dcp(path) or not (path / "model.safetensors.index.json").exists():
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from ckptq.io import SafeFileSystemReader

        md = SafeFileSystemReader(path).read_metadata()
        sd = {
            k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
            for k, m in md.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata)
        }
        dcp.load(sd, storage_reader=SafeFileSystemReader(path), no_dist=True)
        tensors = sd
    else:
        from safetensors.torch import load_file

        index = json.loads((path / "model.safetensors.index.json").read_text())
        tensors = {}
        for shard in sorted(set(index["weight_map"].values())):
            tensors.update(load_file(str(path / shard)))
    for k in sorted(tensors):
        t = tensors[k].contiguous()
        h.update(f"{k} {t.dtype} {tuple(t.shape)}\n".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _whole(dst: Path, refs: dict[str, str]) -> str | None:
    """Which reference output ``dst`` is, bit-exact ('old' or 'new'), or None (after ``ckptq
    verify``'s integrity check of DCP outputs)."""
    from ckptq.verify import check_integrity

    try:
        if _is_dcp(dst):
            s = check_integrity(dst)["summary"]
            if not s["ok"] or s["verified"] != s["records"]:
                return None
        d = digest(dst)
    except Exception:  # noqa: BLE001 - anything unreadable is not a whole output
        return None
    return next((name for name, ref in refs.items() if ref == d), None)


def _leftovers(dst: Path) -> list[str]:
    return sorted(p.name for p in dst.parent.iterdir() if p.name.startswith(f".{dst.name}.ckptq-"))


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = []
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids += (task / "children").read_text().split()
            except OSError:
                pass
        out += [int(k) for k in kids]
        todo += [int(k) for k in kids]
    return out


def _ranks(pid: int) -> dict[int, int]:
    """``{rank: pid}`` of the worker processes under launcher ``pid``."""
    out = {}
    for p in _descendants(pid):
        try:
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{p}/environ").read_text().split("\0") if "=" in kv)
        except OSError:
            continue
        if "RANK" in env and "LOCAL_RANK" in env:
            out[int(env["RANK"])] = p
    return out


def _finish(proc: subprocess.Popen, timeout: float = 180) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return -999, out + "\n[fault_matrix: timed out]"
    return proc.returncode, out


def _wait_staging(dst: Path, proc: subprocess.Popen, limit: float = 120) -> bool:
    t0 = time.time()
    while time.time() - t0 < limit and proc.poll() is None:
        if _leftovers(dst):
            return True
        time.sleep(0.01)
    return False


# ---------------------------------------------------------------------------- the faults
class Matrix:
    def __init__(self, work: Path, seed: int) -> None:
        import torch
        import torch.distributed.checkpoint as dcp

        import ckptq
        from ckptq.export import export_checkpoint
        from ckptq.io import AtomicFileSystemWriter

        warnings.filterwarnings("ignore")
        self.work, self.rng = work, random.Random(seed)
        self.namespace, self.no_namespace = mount_namespace()
        self.src, self.refs, self.sd, self.duration = {}, {}, {}, {}
        for age, s in (("old", 1), ("new", 2)):
            sd = _state(s)
            self.sd[age] = work / f"sd-{age}.pt"
            torch.save(sd, self.sd[age])
            src = self.src[age] = work / f"src-{age}"
            dcp.save(sd, storage_writer=AtomicFileSystemWriter(src), planner=ckptq.QuantizedSavePlanner(), no_dist=True)
            outs = {"save": src, "async_save": src}
            outs["reshard"] = work / f"ref-reshard-{age}"
            ckptq.reshard_checkpoint(src, outs["reshard"], mesh="dp_shard=2,tp=2", plan="fsdp2-tp")
            outs["convert"] = work / f"ref-convert-{age}"
            ckptq.reshard_checkpoint(src, outs["convert"], to="nvfp4")
            outs["export"] = work / f"ref-export-{age}"
            export_checkpoint(src, outs["export"], layout="compressed-tensors", config=False, max_shard_size=SHARD)
            for op, p in outs.items():
                self.refs.setdefault(op, {})[age] = digest(p)
                self.refs[op][f"{age}-path"] = p
        os.chmod(work, 0o755)

    def _fresh(self, op: str, ranks: int, fault: str) -> Path:
        """A folder holding only ``dst``: a copy of the old output of ``op``."""
        d = Path(tempfile.mkdtemp(prefix=f"{fault}-{op}-{ranks}-", dir=self.work))
        dst = d / "dst"
        shutil.copytree(self.refs[op]["old-path"], dst)
        return dst

    def _refs(self, op: str) -> dict[str, str]:
        return {"old": self.refs[op]["old"], "new": self.refs[op]["new"]}

    def _cmd(self, op: str, ranks: int, dst: Path) -> list[str]:
        return _command(op, ranks, self.src["new"], dst, self.sd["new"])

    def measure(self, op: str, ranks: int) -> float:
        """Seconds from the staging folder's appearance to the commit, of one clean overwrite."""
        key = (op, ranks)
        if key not in self.duration:
            dst = self._fresh(op, ranks, "clean")
            proc = _launch(self._cmd(op, ranks, dst))
            _wait_staging(dst, proc)
            t0, t1 = time.time(), None
            while proc.poll() is None and _leftovers(dst):  # until the commit
                time.sleep(0.01)
            t1 = time.time()
            rc, out = _finish(proc)
            if rc != 0 or _whole(dst, self._refs(op)) != "new":
                raise RuntimeError(f"the clean {op} x{ranks} failed (rc {rc}):\n{out[-3000:]}")
            self.duration[key] = max(t1 - t0, 0.05)
            shutil.rmtree(dst.parent)
        return self.duration[key]

    def kill(self, op: str, ranks: int) -> tuple[bool, str, dict]:
        dst = self._fresh(op, ranks, "kill")
        delay = self.rng.uniform(0, self.measure(op, ranks))
        proc = _launch(self._cmd(op, ranks, dst))
        writing = _wait_staging(dst, proc)
        time.sleep(delay)
        pids = _ranks(proc.pid) or {0: proc.pid}
        victim = self.rng.choice(sorted(pids))
        landed_mid_write = bool(_leftovers(dst)) and proc.poll() is None
        try:
            os.kill(pids[victim], signal.SIGKILL)
        except ProcessLookupError:
            landed_mid_write = False
        rc, out = _finish(proc)
        seen = _whole(dst, self._refs(op))
        left = _leftovers(dst)
        info = {"rank": victim, "delay_s": round(delay, 3), "mid_write": landed_mid_write and writing, "rc": rc,
                "dst": seen, "left": left}  # fmt: skip
        if seen is None:
            return False, f"destination not whole after the kill (rc {rc}): {out[-1500:]}", info
        # the next run into dst removes what the killed run left (it must succeed and leave nothing)
        rc2, out2 = _finish(_launch(self._cmd(op, ranks, dst)))
        after = _leftovers(dst)
        info["left_after_next_run"] = after
        if rc2 != 0 or _whole(dst, self._refs(op)) != "new" or after:
            return False, f"the next run after the kill: rc {rc2}, left {after}: {out2[-1500:]}", info
        shutil.rmtree(dst.parent)
        return True, "", info

    def full(self, op: str, ranks: int) -> tuple[bool, str, dict]:
        dst = self._fresh(op, ranks, "full")
        ref = self.refs[op]["new-path"]
        biggest = max(p.stat().st_size for p in ref.rglob("*") if p.is_file())
        if op in ("save", "async_save"):  # the reference is one process's save: each of N ranks writes ~1/N
            biggest //= ranks
        limit = int(biggest * self.rng.uniform(0.05, 0.9))
        rc, out = _finish(_launch(self._cmd(op, ranks, dst), fsize=limit))
        info = {"fsize": limit, "rc": rc, "dst": _whole(dst, self._refs(op)), "left": _leftovers(dst)}
        return self._refused(op, rc, out, info, dst, ("File too large",))

    def enospc(self, op: str, ranks: int) -> tuple[bool, str, dict]:
        """A real full file system: ``dst``'s folder is a tmpfs (in a private mount namespace)
        holding the old output and free space for a random 5-90 % of the new one."""
        mount = Path(tempfile.mkdtemp(prefix=f"enospc-{op}-{ranks}-", dir=self.work))
        spec = mount.parent / f"{mount.name}.json"
        spec.write_text(
            json.dumps({
                "mount": str(mount), "old": str(self.refs[op]["old-path"]), "frac": self.rng.uniform(0.05, 0.9),
                "op": op, "ranks": ranks, "src": str(self.src["new"]), "sd": str(self.sd["new"]),
                "refs": self._refs(op),
            })
        )  # fmt: skip
        child = [*self.namespace, sys.executable, str(Path(__file__).resolve()), "--child-enospc", str(spec)]
        done = subprocess.run(child, env=_env(), capture_output=True, text=True, timeout=300)
        try:
            got = json.loads(done.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return False, f"the trial failed to run: {done.stdout[-1500:]} {done.stderr[-1500:]}", {}
        spec.unlink()
        return self._refused(op, got["rc"], got["out"], got["info"], mount / "dst", ("No space left on device",))

    def readonly(self, op: str, ranks: int) -> tuple[bool, str, dict]:
        dst = self._fresh(op, ranks, "readonly")
        os.chmod(dst.parent, 0o555)
        try:
            rc, out = _finish(_launch(self._cmd(op, ranks, dst), unprivileged=os.geteuid() == 0))
        finally:
            os.chmod(dst.parent, 0o755)
        info = {"rc": rc, "dst": _whole(dst, self._refs(op)), "left": _leftovers(dst)}
        return self._refused(op, rc, out, info, dst, ("not writable", "Permission denied"))

    def _refused(self, op, rc, out, info, dst, causes) -> tuple[bool, str, dict]:
        lines = [ln.strip() for ln in out.splitlines()]
        errors = [  # an error line naming the destination, with the lines that continue it
            " ".join(lines[i : i + 3])
            for i, ln in enumerate(lines)
            if "Error" in ln and (str(dst) in ln or f".{dst.name}." in ln)
        ]
        if op == "async_save":  # the error must come out of the future, as a CkptqError
            errors = [m for m in errors if "future.result() raised CkptqError" in m]
        found = next((m[:600] for m in errors if any(c in m for c in causes)), None)
        info["message"] = found and found.replace(str(self.work), "$WORK")
        problems = []
        if rc == 0:
            problems.append("the job succeeded")
        if info["dst"] != "old":
            problems.append(f"the old output is not intact ({info['dst']})")
        if info["left"]:
            problems.append(f"left {info['left']}")
        if info["message"] is None:
            problems.append("no error naming the destination and the cause")
        if not problems:
            shutil.rmtree(dst.parent)
        return not problems, "; ".join(problems) + ("" if not problems else f": {out[-1500:]}"), info

    def reader(self, op: str, ranks: int) -> tuple[bool, str, dict]:
        dst = self._fresh(op, ranks, "reader")
        stop = dst.parent / "stop"
        code = (
            f"import sys, time, json; sys.path.insert(0, {str(ROOT)!r}); sys.argv = ['x']\n"
            f"from pathlib import Path; import importlib.util as u\n"
            f"s = u.spec_from_file_location('fm', {str(Path(__file__).resolve())!r}); m = u.module_from_spec(s)\n"
            f"s.loader.exec_module(m)\n"
            f"refs = {self._refs(op)!r}; dst = Path({str(dst)!r}); stop = Path({str(stop)!r})\n"
            f"seen = {{'old': 0, 'new': 0, 'mix': 0, 'error': 0, 'errors': []}}\n"
            f"print('ready', flush=True)\n"
            f"while not stop.exists():\n"
            f"    try:\n"
            f"        d = m.digest(dst)\n"
            f"        seen[next((k for k, v in refs.items() if v == d), 'mix')] += 1\n"
            f"    except Exception as e:\n"
            f"        seen['error'] += 1\n"
            f"        seen['errors'] = (seen['errors'] + [f'{{type(e).__name__}}: {{e}}'[:300]])[:3]\n"
            f"print(json.dumps(seen), flush=True)\n"
        )
        rd = subprocess.Popen([sys.executable, "-c", code], env=_env(), stdout=subprocess.PIPE, text=True)
        assert rd.stdout.readline().strip() == "ready"
        time.sleep(self.rng.uniform(0, 1.0))
        rc, out = _finish(_launch(self._cmd(op, ranks, dst)))
        time.sleep(self.rng.uniform(0.2, 1.0))
        stop.touch()
        seen = json.loads(rd.communicate(timeout=120)[0].strip().splitlines()[-1])
        info = {"rc": rc, **seen, "dst": _whole(dst, self._refs(op))}
        problems = []
        if rc != 0:
            problems.append(f"the overwrite failed: {out[-1500:]}")
        if seen["mix"] or seen["error"]:
            problems.append(f"{seen['mix']} mixed loads, {seen['error']} failed loads {seen['errors']}")
        if not seen["old"] + seen["new"]:
            problems.append("no load completed")
        if not problems:
            shutil.rmtree(dst.parent)
        return not problems, "; ".join(problems), info


def run(work: Path, trials: int, seed: int, ranks=(2, 4), ops=OPS, faults=FAULTS, log=print) -> dict:
    m = Matrix(work, seed)
    rows = []
    for fault in faults:
        for op in ops:
            for n in (1,) if op == "export" else ranks:
                row = {"fault": fault, "op": op, "ranks": n, "trials": 0, "passed": 0, "failures": [], "trial": []}
                if fault == "enospc" and m.namespace is None:
                    row["skipped"] = m.no_namespace
                    log(f"{fault:8s} {op:10s} x{n}: skipped ({m.no_namespace})")
                    rows.append(row)
                    continue
                for _ in range(trials):
                    t0 = time.time()
                    ok, why, info = getattr(m, fault)(op, n)
                    info["s"] = round(time.time() - t0, 1)
                    row["trials"] += 1
                    row["passed"] += ok
                    row["trial"].append(info)
                    if not ok:
                        row["failures"].append(why)
                    log(f"{fault:8s} {op:10s} x{n}: {'ok  ' if ok else 'FAIL'} {json.dumps(info)[:300]}")
                    if not ok:
                        log("    " + why[:2000])
                rows.append(row)
    return {"rows": rows, "durations_s": {f"{k[0]} x{k[1]}": round(v, 2) for k, v in m.duration.items()}}


EXPECT = {
    "kill": "the old or the new output, whole; the next run removes the staging folder",
    "full": "error names dst + EFBIG; old output unchanged; no staging left",
    "enospc": "error names dst + ENOSPC; old output unchanged; no staging left",
    "readonly": "error names dst (read-only); old output unchanged; nothing left",
    "reader": "every load: exactly the old or the new tensors (bytes); no error",
}


def markdown(result: dict) -> str:
    lines = [
        "| fault | operation | ranks | trials | passed | outcome | details |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        t = r["trial"]
        if r["fault"] == "kill":
            det = (
                f"{sum(x['mid_write'] for x in t)} kills mid-write; after the kill dst was "
                f"old {sum(x['dst'] == 'old' for x in t)} / new {sum(x['dst'] == 'new' for x in t)}; "
                f"ranks killed {sorted({x['rank'] for x in t})}"
            )
        elif r["fault"] == "reader":
            det = f"{sum(x['old'] for x in t)} loads saw old, {sum(x['new'] for x in t)} new, " + (
                f"{sum(x['mix'] for x in t)} mixed, {sum(x['error'] for x in t)} failed"
            )
        else:
            msg = next((x["message"] for x in t if x.get("message")), "") or ""
            det = "e.g. `" + msg.replace("|", "/")[:160] + "`"
        if r.get("skipped"):
            outcome, det = f"skipped: {r['skipped']}", ""
        else:
            outcome = EXPECT[r["fault"]] if r["passed"] == r["trials"] else "**FAILED**: " + r["failures"][0][:200]
        lines.append(f"| {r['fault']} | {r['op']} | {r['ranks']} | {r['trials']} | {r['passed']} | {outcome} | {det} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child-save":
        _save_child(sys.argv[2], sys.argv[3], sys.argv[4])
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--child-enospc":
        _enospc_child(sys.argv[2])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=2, help="trials per fault x operation x ranks")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    ap.add_argument("--faults", nargs="+", default=list(FAULTS), choices=FAULTS)
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ckptq-faults-"))
    try:
        result = run(work, args.trials, args.seed, tuple(args.ranks), tuple(args.ops), tuple(args.faults))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["command"] = " ".join(["python", "scripts/fault_matrix.py", *sys.argv[1:]])
    table = markdown(result)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if args.md:
        Path(args.md).write_text(table)
    return 0 if all(r["passed"] == r["trials"] for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
