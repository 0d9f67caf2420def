"""bench/carry_wheels.py against a local fake of the transfer: split here, carry batch by batch into a
"device" folder, reassemble, verify and install; a corrupt and a missing part stop it, naming the part."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from bench import carry_wheels as cw

KIB = 1024


def _wheel(folder: Path, name: str, payload: bytes) -> Path:
    """A minimal valid pure-Python wheel carrying ``payload`` (so pip can install it)."""
    dist = f"{name}-1.0"
    path = folder / f"{name}-1.0-py3-none-any.whl"
    files = {
        f"{name}/__init__.py": b"VALUE = 42\n",
        f"{name}/blob.bin": payload,
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(),
        f"{dist}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{k},,\n" for k in files) + f"{dist}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for k, v in files.items():
            z.writestr(k, v)
        z.writestr(f"{dist}.dist-info/RECORD", record)
    return path


@pytest.fixture
def packed(tmp_path: Path) -> tuple[Path, dict, list[Path]]:
    """Two wheels (≈ 300 KiB and ≈ 40 KiB; incompressible payloads), batches of at most 128 KiB."""
    src = tmp_path / "downloaded"
    src.mkdir()
    big = _wheel(src, "bigpkg", bytes(range(256)) * 1200 + hashlib.sha256(b"x").digest() * 500)
    small = _wheel(src, "smallpkg", b"s" * 40 * KIB)
    dest = tmp_path / ".whl"
    manifest = cw.pack([big, small], dest, batch_bytes=128 * KIB)
    return dest, manifest, [big, small]


def _carry(dest: Path, device: Path, batches: list[int]) -> None:
    """Each call: its batch folder lands in the device's fresh copy of the repository, then is received."""
    for k in batches:
        repo = device / f"call-{k}"  # every call gets a new copy of the tree; only the store persists
        shutil.copytree(dest / f"batch-{k}", repo / ".whl" / f"batch-{k}")
        cw.receive(repo / ".whl" / f"batch-{k}", device / "store")
        shutil.rmtree(repo)


def test_split_batches_fit_one_call_each(packed) -> None:
    dest, manifest, wheels = packed
    big = manifest["wheels"][0]
    assert big["size"] > 128 * KIB and len(big["parts"]) == -(-big["size"] // (128 * KIB))
    for k in range(1, manifest["batches"] + 1):
        parts = [p for p in (dest / f"batch-{k}").iterdir() if p.name != "manifest.json"]
        assert parts and sum(p.stat().st_size for p in parts) <= 128 * KIB
    assert sum(p["size"] for p in big["parts"]) == wheels[0].stat().st_size
    assert manifest["batches"] == len(list(dest.glob("batch-*")))


def test_carried_batch_by_batch_then_reassembled_and_installed(packed, tmp_path: Path) -> None:
    dest, manifest, wheels = packed
    device = tmp_path / "device"
    _carry(dest, device, list(range(1, manifest["batches"] + 1)))
    rebuilt = cw.reassemble(device / "store")
    assert [w.read_bytes() for w in rebuilt] == [w.read_bytes() for w in wheels]
    site = tmp_path / "site"
    assert cw.install(device / "store", target=site) == [w.name for w in wheels]
    out = subprocess.run([sys.executable, "-c", "import bigpkg, smallpkg; print(bigpkg.VALUE)"],
                         env={"PYTHONPATH": str(site)}, capture_output=True, text=True, check=True)  # fmt: skip
    assert out.stdout.strip() == "42"


def test_corrupt_part_is_refused_when_received(packed, tmp_path: Path) -> None:
    dest, _, _ = packed
    part = next(p for p in (dest / "batch-1").iterdir() if ".part" in p.name)
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(cw.CarryError, match=rf"{part.name} \(batch 1\) is corrupt"):
        _carry(dest, tmp_path / "device", [1])
    assert cw.main(["receive", str(dest / "batch-1"), "--store", str(tmp_path / "s")]) == 1


def test_part_corrupted_after_receipt_is_refused_at_reassembly(packed, tmp_path: Path) -> None:
    dest, manifest, _ = packed
    device = tmp_path / "device"
    _carry(dest, device, list(range(1, manifest["batches"] + 1)))
    stored = device / "store" / manifest["wheels"][0]["parts"][0]["name"]
    stored.write_bytes(stored.read_bytes()[:-1] + b"\0")
    with pytest.raises(cw.CarryError, match="is corrupt"):
        cw.install(device / "store", target=tmp_path / "site")
    assert not (tmp_path / "site").exists()  # nothing installed


def test_missing_batch_names_its_parts(packed, tmp_path: Path) -> None:
    dest, manifest, _ = packed
    assert manifest["batches"] >= 3
    device = tmp_path / "device"
    _carry(dest, device, [k for k in range(1, manifest["batches"] + 1) if k != 2])
    lost = [p["name"] for w in manifest["wheels"] for p in w["parts"] if p["batch"] == 2]
    with pytest.raises(cw.CarryError, match="not received") as info:
        cw.reassemble(device / "store")
    assert all(f"{name} (batch 2)" in str(info.value) for name in lost)
    assert cw.main(["install", "--store", str(device / "store"), "--target", str(tmp_path / "t")]) == 1


def test_part_missing_from_a_carried_batch(packed, tmp_path: Path) -> None:
    dest, _, _ = packed
    part = next(p for p in (dest / "batch-1").iterdir() if ".part" in p.name)
    part.unlink()
    with pytest.raises(cw.CarryError, match=rf"{part.name} \(batch 1\) is missing"):
        _carry(dest, tmp_path / "device", [1])


def test_plan_names_one_call_per_batch_and_runs_the_suite_last(packed) -> None:
    _, manifest, _ = packed
    calls = cw.plan_calls(manifest).splitlines()
    assert len(calls) == manifest["batches"]
    assert all(f'carry=[".whl/batch-{k}"]' in c for k, c in enumerate(calls, 1))
    assert "gpu_suite.py --wheels /tmp/amplite-wheels" in calls[-1]
    assert all("gpu_suite" not in c for c in calls[:-1])
