"""Carry nvmath-python and the cuTENSOR wheel to a device machine whose uploads hold at most 64 MiB each.

The device machine has no network: wheels travel with the working tree (docs/gpu.md), and one call carries
at most 64 MiB, the repository included. ``cutensor-cu13`` alone is 210 MB, so the wheels are split into
parts, grouped into batches that each fit one call, received batch by batch into a folder that outlives
the calls (the machine stays the same while it is warm), and reassembled, verified and installed there.

Here, on a networked machine (writes ``.whl/``, which ``.gitignore`` keeps out of git)::

    python bench/carry_wheels.py pack                    # pip download + split + batches .whl/batch-1..N
    python bench/carry_wheels.py plan                    # the device calls, one per batch, to copy-paste

There, one call per batch (each ``run`` carries ``.whl/batch-K``), then the suite::

    python bench/carry_wheels.py receive .whl/batch-K    # verifies each part's sha256, stores it
    python bench/carry_wheels.py install                 # reassembles, verifies every wheel, pip installs

``manifest.json`` (in every batch) lists each wheel with its size and sha256 and its parts with theirs.
Any missing or corrupt part, or a reassembled wheel whose sha256 differs, stops with exit 1 and names it:
nothing is installed from a wheel that is not exactly the one downloaded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: What ``pack`` downloads: the nvmath-python 1.x the ``cutensor`` extra pins and the CUDA 13 cuTENSOR (the
#: lent machines run torch +cu130). Their other requirements (cuda-bindings, cuda-core, cuda-pathfinder,
#: numpy) are in the machines' image (/work/.library/device/KINDS.md); add ``NAME==VER`` to carry others.
PACKAGES = ("nvmath-python==1.0.1", "cutensor-cu13==2.8.1")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
MIB = 2**20
#: One call carries 64 MiB including the repository (≈ 4 MiB): batches leave 8 MiB for it.
BATCH_BYTES = 56 * MIB
DEST = ROOT / ".whl"
STORE = Path("/tmp/amplite-wheels")
#: The last call: the suite, which installs the received wheels first (its time counted), writing into $OUT.
SUITE = "PYTHONUNBUFFERED=1 python3 bench/gpu_suite.py --wheels /tmp/amplite-wheels --out $OUT"


class CarryError(RuntimeError):
    """A part or wheel is missing or corrupt; the message names it."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(MIB), b""):
            h.update(chunk)
    return h.hexdigest()


def download(packages: list[str], dest: Path, python_version: str = "3.12") -> list[Path]:
    """``pip download`` the wheels for the device (Linux x86-64, CPython ``python_version``) into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
           python_version, "--implementation", "cp", *(a for p in PLATFORMS for a in ("--platform", p)),
           "-d", str(dest), *packages]  # fmt: skip
    subprocess.run(cmd, check=True)
    names = {p.split("==")[0].replace("-", "_").lower() for p in packages}
    return sorted(w for w in dest.glob("*.whl") if w.name.split("-")[0].lower() in names)


def pack(wheels: list[Path], dest: Path, batch_bytes: int = BATCH_BYTES) -> dict[str, Any]:
    """Split ``wheels`` into parts of at most ``batch_bytes`` and group them into ``dest/batch-K`` folders.

    Each batch holds whole parts (at most ``batch_bytes`` together) and a copy of the manifest.

    Returns:
        The manifest: ``{"wheels": [{"name", "size", "sha256", "parts": [{"name", "size", "sha256",
        "batch"}]}], "batches": N}``.
    """
    for old in dest.glob("batch-*"):
        shutil.rmtree(old)
    parts_dir = dest / "parts"
    shutil.rmtree(parts_dir, ignore_errors=True)
    parts_dir.mkdir(parents=True)
    manifest: dict[str, Any] = {"wheels": [], "batches": 0}
    for wheel in wheels:
        entry = {"name": wheel.name, "size": wheel.stat().st_size, "sha256": sha256(wheel), "parts": []}
        with open(wheel, "rb") as fh:
            for i, chunk in enumerate(iter(lambda: fh.read(batch_bytes), b"")):
                part = parts_dir / f"{wheel.name}.part{i:03d}"
                part.write_bytes(chunk)
                entry["parts"].append({"name": part.name, "size": len(chunk),
                                       "sha256": hashlib.sha256(chunk).hexdigest()})  # fmt: skip
        manifest["wheels"].append(entry)
    # First fit, largest parts first: as few batches (device calls) as the sizes allow.
    parts = sorted((p for w in manifest["wheels"] for p in w["parts"]), key=lambda p: -p["size"])
    loads: list[int] = []
    for p in parts:
        k = next((i for i, load in enumerate(loads) if load + p["size"] <= batch_bytes), None)
        if k is None:
            loads.append(0)
            k = len(loads) - 1
        loads[k] += p["size"]
        p["batch"] = k + 1
    manifest["batches"] = len(loads)
    for k in range(1, len(loads) + 1):
        folder = dest / f"batch-{k}"
        folder.mkdir()
        for p in parts:
            if p["batch"] == k:
                shutil.move(parts_dir / p["name"], folder / p["name"])
        (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))
    parts_dir.rmdir()
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def receive(batch: Path, store: Path = STORE) -> list[str]:
    """Verify the parts of one carried batch against its manifest and copy them into ``store``.

    Raises:
        CarryError: No manifest, a part of this batch missing, or one whose size or sha256 differs.
    """
    if not (batch / "manifest.json").is_file():
        raise CarryError(f"{batch}: no manifest.json (was the batch carried? name it in the run's carry)")
    manifest = json.loads((batch / "manifest.json").read_text())
    store.mkdir(parents=True, exist_ok=True)
    got = []
    for wheel in manifest["wheels"]:
        for p in wheel["parts"]:
            if p["batch"] != int(batch.name.rsplit("-", 1)[-1]):
                continue
            src = batch / p["name"]
            if not src.is_file():
                raise CarryError(f"{p['name']} (batch {p['batch']}) is missing from {batch}")
            if src.stat().st_size != p["size"] or sha256(src) != p["sha256"]:
                raise CarryError(f"{p['name']} (batch {p['batch']}) is corrupt: size or sha256 differs")
            shutil.copyfile(src, store / p["name"])
            got.append(p["name"])
    shutil.copyfile(batch / "manifest.json", store / "manifest.json")
    return got


def reassemble(store: Path = STORE) -> list[Path]:
    """Join every wheel's parts in ``store`` and verify it; the wheels' paths.

    Raises:
        CarryError: Parts missing (named, with the batch that carries them), corrupt, or a wheel whose
            sha256 differs from the downloaded one.
    """
    if not (store / "manifest.json").is_file():
        raise CarryError(f"{store}: no manifest.json (receive at least one batch first)")
    manifest = json.loads((store / "manifest.json").read_text())
    missing = [f"{p['name']} (batch {p['batch']})" for w in manifest["wheels"] for p in w["parts"]
               if not (store / p["name"]).is_file()]  # fmt: skip
    if missing:
        raise CarryError(f"{len(missing)} part(s) not received: {', '.join(missing)}")
    wheels = []
    for w in manifest["wheels"]:
        out = store / w["name"]
        with open(out, "wb") as fh:
            for p in w["parts"]:
                data = (store / p["name"]).read_bytes()
                if hashlib.sha256(data).hexdigest() != p["sha256"]:
                    raise CarryError(f"{p['name']} is corrupt in {store}: sha256 differs")
                fh.write(data)
        if out.stat().st_size != w["size"] or sha256(out) != w["sha256"]:
            out.unlink()
            raise CarryError(f"{w['name']}: the reassembled wheel's sha256 differs from the downloaded one")
        wheels.append(out)
    return wheels


def install(store: Path = STORE, target: Path | None = None) -> list[str]:
    """Reassemble, verify and ``pip install --no-index --no-deps`` the carried wheels; their file names."""
    wheels = reassemble(store)
    where = ["--target", str(target)] if target else []  # default: the running interpreter's environment
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-cache-dir",
           "--disable-pip-version-check", *where, *map(str, wheels)]  # fmt: skip
    subprocess.run(cmd, check=True)
    return [w.name for w in wheels]


def plan_calls(manifest: dict[str, Any], suite: str = SUITE) -> str:
    """The device ``run`` calls that carry and install the batches, then run the suite, one per line."""
    n = manifest["batches"]
    lines = []
    for k in range(1, n + 1):
        cmd = f"python3 bench/carry_wheels.py receive .whl/batch-{k}"
        if k == n:
            cmd += f" && {suite}"
        lines.append(f'run(carry=[".whl/batch-{k}"], command="{cmd}")')
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="download, split and batch the wheels (networked machine)")
    p.add_argument("packages", nargs="*", default=list(PACKAGES))
    p.add_argument("--dest", type=Path, default=DEST)
    p.add_argument("--batch-mib", type=float, default=BATCH_BYTES / MIB)
    sub.add_parser("plan", help="print the device calls for the packed batches").add_argument(
        "--dest", type=Path, default=DEST
    )
    r = sub.add_parser("receive", help="store one carried batch (device)")
    r.add_argument("batch", type=Path)
    r.add_argument("--store", type=Path, default=STORE)
    i = sub.add_parser("install", help="reassemble, verify and install (device)")
    i.add_argument("--store", type=Path, default=STORE)
    i.add_argument("--target", type=Path, default=None)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "pack":
            wheels = download(args.packages, args.dest / "download")
            manifest = pack(wheels, args.dest, int(args.batch_mib * MIB))
            for w in manifest["wheels"]:
                print(f"{w['name']}: {w['size'] / MIB:.1f} MiB in {len(w['parts'])} part(s)")
            print(plan_calls(manifest))
        elif args.cmd == "plan":
            print(plan_calls(json.loads((args.dest / "manifest.json").read_text())))
        elif args.cmd == "receive":
            print(f"carry_wheels: received {', '.join(receive(args.batch, args.store)) or 'no part'}")
        else:
            print(f"carry_wheels: installed {', '.join(install(args.store, args.target))}")
    except CarryError as e:
        print(f"carry_wheels: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
