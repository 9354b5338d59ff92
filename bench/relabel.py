"""Relabelling at disk speed: `place export --format checkpoint` on a K3-shaped checkpoint (K3's tensor count
and names -- 92 MoE layers x 896 experts x w1/w2/w3 x weight_packed / weight_scale / weight_shape, routers and
biases -- at a scaled-down byte size; moeplace/placement/export/sample_checkpoint.py), against `cp -r` of the
same checkpoint on the same disk, and on a reflink file system (a loop-mounted XFS image) the bytes the
relabelling newly writes.

    python bench/relabel.py [--gb 4] [--repeats 3] [--dir bench] [--no-xfs]

Each repeat runs `cp -r SRC COPY` and the relabelling command (a fresh process: start-up, header scan, plan,
write) back to back, alternating which goes first, each from SRC evicted from the page cache and until its
output is fsynced (on the disk), and the ratio is taken within the repeat; the figures are medians over the
repeats. The experts keep K3's intermediate size (3072) and shrink the latent width, so the router rows keep
their K3 share of the bytes; the headers and index (K3's names) do not shrink.

The header work (reading, checking and planning K3's 0.7 M tensor names, which does not grow with the bytes)
is timed on its own with --dry-run ("fixed"). The write plans each shard while the one before it is copied
(on another thread), so that work runs alongside the copy and is *not* subtracted from the write's time: the
data rate reported is the whole command's (checkpoint bytes / relabel seconds), and the projection for K3's
1.56 TB on this disk scales the whole command by the bytes (an upper estimate: at K3's size the header work
is a far smaller share). The 3 GB/s NVMe projection adds the header work to the bytes at that rate, as if it
did not overlap (an upper estimate too). cp's and the relabelling's CPU seconds are recorded (the copy in
the kernel costs CPU: on 2 cores the header work competes with it). Prints the figures and writes
bench/results/relabel.json.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
K3_BYTES = 1.56e12  # Kimi K3's checkpoint (96 shards, 93 % routed experts)
NVME = 3e9  # bytes/s: the NVMe the projection assumes


def _cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _place(*args: str) -> tuple[float, dict]:
    """A place command in a fresh process: (wall s, its --json); its CPU seconds in ``doc["_cpu_s"]``."""
    t, c = time.perf_counter(), _cpu_children()
    out = subprocess.run([sys.executable, "-m", "moeplace.cli", *args, "--json"], check=True, capture_output=True,
                         text=True, cwd=REPO)
    doc = json.loads(out.stdout)
    doc["_cpu_s"] = _cpu_children() - c
    return time.perf_counter() - t, doc


def _files(d: Path) -> list[Path]:
    return [p for p in d.rglob("*") if p.is_file()]


def _durable(d: Path) -> None:
    """fsync every file under ``d`` (its writes on the disk, not in the page cache; only these files')."""
    for p in _files(d):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _evict(d: Path) -> None:
    """Drop ``d``'s (clean) pages from the page cache, so the next reader reads the disk (only these files)."""
    for p in _files(d):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _cp(src: Path, dst: Path, reflink: str | None = None) -> tuple[float, float]:
    """``cp -r`` until its copy is on the disk: (wall s, cp's CPU s)."""
    t, c = time.perf_counter(), _cpu_children()
    subprocess.run(["cp", "-r", *([f"--reflink={reflink}"] if reflink else []), str(src), str(dst)], check=True)
    cpu = _cpu_children() - c
    _durable(dst)
    return time.perf_counter() - t, cpu


def _size_for(gb: float, layers: int, experts: int, inter: int) -> int:
    """The latent width (hidden / 2) at which K3's experts (w1/w2/w3 at 4 bits + E8M0 scales, K3's
    intermediate size ``inter``) come to about ``gb`` GB: the router rows and headers keep K3's share."""
    per_value = 0.5 + 1 / 32
    latent = gb * 1e9 / (layers * experts * 3 * per_value * inter)
    return max(2, round(latent / 2) * 2)


def _make(root: Path, gb: float, shards: int) -> tuple[int, Path, int]:
    sys.path.insert(0, str(REPO))
    from moeplace.foundation.model import load_model
    from moeplace.placement.export.sample_checkpoint import write_k3_like
    from moeplace.placement.record import Placement

    model = load_model("kimi-k3")
    inter = model.moe_intermediate_size  # K3's: its router rows are the experts' share they are in K3
    hidden = 2 * _size_for(gb, model.num_moe_layers, model.num_experts, inter)
    size = write_k3_like(root / "src", model, hidden=hidden, inter=inter, shards=shards)
    rng = np.random.default_rng(1)
    p = Placement(np.stack([rng.permutation(model.num_experts) for _ in model.moe_layers]), 32, 8, "kimi-k3",
                  model.num_experts, tuple(model.moe_layers))
    p.save(root / "p.json")
    n_tensors = sum(1 for _ in json.loads((root / "src" / "model.safetensors.index.json").read_text())["weight_map"])
    return size, root / "p.json", n_tensors


def _relabel(root: Path, src: Path, dst: Path) -> tuple[float, dict]:
    """The relabelling command until its checkpoint is on the disk."""
    t = time.perf_counter()
    _, doc = _place("export", str(root / "p.json"), "--format", "checkpoint", "--model-path", str(src), "--out",
                    str(dst))
    _durable(dst)
    return time.perf_counter() - t, doc


def on_disk(root: Path, repeats: int) -> dict:
    src = root / "src"
    rows = []
    for i in range(repeats):
        order = ("cp", "relabel") if i % 2 == 0 else ("relabel", "cp")
        got = {}
        for what in order:
            _evict(src)
            if what == "cp":
                got["cp_s"], got["cp_cpu_s"] = _cp(src, root / "copy")
                shutil.rmtree(root / "copy")
            else:
                got["relabel_s"], doc = _relabel(root, src, root / "dst")
                got["written"] = doc["written_bytes"]
                got["relabel_cpu_s"] = doc["_cpu_s"]
                shutil.rmtree(root / "dst")
        got["ratio"] = got["relabel_s"] / got["cp_s"]
        rows.append(got)
        print(f"  repeat {i + 1}: cp {got['cp_s']:.1f} s, relabel {got['relabel_s']:.1f} s, ratio {got['ratio']:.3f}",
              flush=True)
    dry = [_place("export", str(root / "p.json"), "--format", "checkpoint", "--model-path", str(src), "--out",
                  str(root / "dst"), "--dry-run") for _ in range(repeats)]
    fixed_s, fixed_cpu = statistics.median(d[0] for d in dry), statistics.median(d[1]["_cpu_s"] for d in dry)
    med = lambda k: statistics.median(r[k] for r in rows)
    return {"repeats": rows, "median_cp_s": med("cp_s"), "median_relabel_s": med("relabel_s"),
            "median_ratio": med("ratio"), "median_cp_cpu_s": med("cp_cpu_s"),
            "median_relabel_cpu_s": med("relabel_cpu_s"), "median_fixed_s": fixed_s, "median_fixed_cpu_s": fixed_cpu}


def _mount_xfs(img: Path, mnt: Path, gb: float) -> str | None:
    """Mount a fresh reflink XFS image at ``mnt``; the reason when this machine cannot."""
    if shutil.which("mkfs.xfs") is None:
        return "mkfs.xfs not installed (apt-get install xfsprogs)"
    with open(img, "wb") as f:
        f.truncate(int((2.4 * gb + 1) * 1e9))
    r = subprocess.run(["mkfs.xfs", "-q", "-m", "reflink=1", str(img)], check=False, capture_output=True, text=True)
    if r.returncode:
        return f"mkfs.xfs failed: {r.stderr.strip()}"
    mnt.mkdir()
    r = subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], check=False, capture_output=True, text=True)
    if r.returncode:
        return f"mount -o loop failed: {r.stderr.strip() or r.returncode} (a sandbox without loop devices or root)"
    return None


def _used(mnt: Path) -> int:
    subprocess.run(["sync", "-f", str(mnt)], check=True)
    st = os.statvfs(mnt)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def on_xfs(base: Path, gb: float, shards: int) -> dict:
    img, mnt = base / "xfs.img", base / "xfs"
    why = _mount_xfs(img, mnt, gb)
    if why:
        return {"blocked": why}
    try:
        size, _, _ = _make(mnt, gb, shards)
        before = _used(mnt)
        t, doc = _relabel(mnt, mnt / "src", mnt / "dst")
        new = _used(mnt) - before
        headers = sum(8 + int.from_bytes(p.open("rb").read(8), "little") for p in (mnt / "src").glob("*.safetensors"))
        index = (mnt / "src" / "model.safetensors.index.json").stat().st_size
        return {"checkpoint_bytes": size, "relabel_s": round(t, 2), "newly_allocated_bytes": new,
                "newly_allocated_share": new / size, "header_bytes": headers, "index_bytes": index,
                "writer_reported": {"written": doc["written_bytes"], "reflinked": doc["reflinked_bytes"]}}
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
        img.unlink(missing_ok=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=10.0, help="scaled-down checkpoint size (default 10 GB)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shards", type=int, default=96, help="shards (K3: 96)")
    ap.add_argument("--dir", default=str(REPO / "bench"), help="where the checkpoints go (one disk)")
    ap.add_argument("--no-xfs", action="store_true", help="skip the reflink (loop-mounted XFS) measurement")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="relabel-") as tmp:
        root = Path(tmp)
        size, _, n_tensors = _make(root, a.gb, a.shards)
        print(f"K3-shaped checkpoint: {n_tensors:,} tensors in {a.shards} shards, {size / 1e9:.2f} GB "
              f"(load average {os.getloadavg()[0]:.1f})", flush=True)
        disk = on_disk(root, a.repeats)
        shutil.rmtree(root / "src")
        xfs = {"skipped": "--no-xfs"} if a.no_xfs else on_xfs(root, a.gb, a.shards)
    fixed = disk["median_fixed_s"]
    bytes_s = size / disk["median_relabel_s"]  # the whole command: its header work runs alongside the copy
    cp_bytes_s = size / disk["median_cp_s"]
    share = xfs.get("newly_allocated_share")
    if share is not None:
        # at K3's 1.56 TB: the same headers and index (K3's names), K3's router rows (92 x 896 x 7168 BF16) and
        # what else the file system allocated, scaled with the bytes
        k3_router = 92 * 896 * 7168 * 2
        xfs["projected_k3_share"] = (xfs["header_bytes"] + xfs["index_bytes"] + k3_router + a.shards * 2 * 4096
                                     ) / K3_BYTES  # an estimate: the written parts at K3's sizes
    res = {
        "checkpoint_bytes": size, "tensors": n_tensors, "shards": a.shards, "repeats": a.repeats,
        "load_average": round(os.getloadavg()[0], 1),
        "disk": {**disk, "cp_mb_per_s": round(cp_bytes_s / 1e6, 1), "relabel_data_mb_per_s": round(bytes_s / 1e6, 1)},
        "target_ratio": 1.1, "ratio_met": disk["median_ratio"] <= 1.1,
        "reflink": xfs, "target_reflink_share": 0.02,
        "reflink_met": None if share is None else share <= 0.02,
        "projected_k3_s": {
            "this_disk": round(K3_BYTES / bytes_s, 0),
            "this_disk_cp": round(K3_BYTES / cp_bytes_s, 0),
            "nvme_3gb_s": round(fixed + K3_BYTES / NVME, 0),
            "nvme_3gb_s_reflink": None if share is None else round(fixed + share * K3_BYTES / NVME, 0),
        },
        "note": "ratio = relabel command (a fresh process) / cp -r of the same checkpoint, in the same repeat; "
                "fixed = relabel --dry-run (headers read, checked and planned at K3's tensor count, nothing written), "
                "timed alone: the write plans each shard while the one before it is copied, so this work overlaps "
                "the copy and is not subtracted; relabel_data_mb_per_s = checkpoint bytes / the whole command's "
                "seconds; this_disk = K3's 1.56 TB at that rate (an upper estimate: the header work is a smaller "
                "share at K3's size); nvme_3gb_s = fixed + 1.56 TB at an assumed 3 GB/s (no overlap assumed; every "
                "byte read and written once; with reflink only the newly written share); cpu_s: user + system "
                "seconds of the process (cp's copy in the kernel is CPU work too)",
    }
    print(json.dumps(res, indent=1))
    print(f"relabel / cp: {disk['median_ratio']:.3f} (target <= 1.1); CPU s: relabel {disk['median_relabel_cpu_s']:.1f}, "
          f"cp {disk['median_cp_cpu_s']:.1f}; header work alone {fixed:.1f} s ({disk['median_fixed_cpu_s']:.1f} "
          f"CPU s, overlapped with the copy in the write) at {n_tensors:,} tensors; reflink: " + (f"{share:.3%} of the bytes newly written (target <= 2 %)" if share is not None
                                   else xfs.get("blocked", xfs.get("skipped", "?"))))
    p = res["projected_k3_s"]
    print(f"projected K3 (1.56 TB): this disk {p['this_disk'] / 60:.0f} min (cp {p['this_disk_cp'] / 60:.0f} min), "
          f"3 GB/s NVMe {p['nvme_3gb_s'] / 60:.1f} min"
          + (f", with reflink {p['nvme_3gb_s_reflink'] / 60:.1f} min" if p["nvme_3gb_s_reflink"] is not None else ""))
    out = REPO / "bench" / "results" / "relabel.json"
    out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
