"""Inspect a ``torch.export`` archive (.pt2) before any of it is deserialized.

``torch.export.load`` trusts the file: sample inputs fall back to ``torch.load(weights_only=False)``,
``use_pickle`` weights and constants are loaded with ``weights_only=False``, custom objects go through
``torch._C._pickle_load_obj``, opaque objects through ``pickle.loads``, the legacy weights/constants files
through the same fallback, AOTInductor entries are ``dlopen``-ed, and strings of the program JSON reach
``sympy.sympify`` (an ``eval``), the guard function torch ``exec``-s, and FX's generated code.

:func:`inspect_archive` reads the zip's directory and the JSON entries through the reader torch uses and
checks them (sizes, duplicate names, schemas, weight sizes; the strings listed above in
:mod:`amplite.reading.program_strings`) without unpickling
anything. It returns the parsed pieces and the list of entries that need unpickling; the safe loader
(:mod:`amplite.reading.pt2`) then builds the program from them itself, so what was checked is what is
loaded. See ``docs/security.md``.
"""

from __future__ import annotations

import io
import json
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from amplite.errors import LoadError
from amplite.reading.program_strings import FQN, check_program_strings

#: Declared uncompressed bytes may exceed the file's size by at most this factor plus the slack: torch
#: writes entries uncompressed, so a larger claim is a zip bomb (or a corrupt directory).
MAX_EXPANSION = 4
SLACK_BYTES = 64 << 20
MODEL = "model"
WEIGHTS, CONSTANTS = "data/weights/", "data/constants/"
SAMPLE_INPUTS = f"data/sample_inputs/{MODEL}.pt"
_RE_FIX = "re-save the model with torch.export.save (and copy the file again)"
TRUST_FIX = "pass --trust-pickle (trust_pickle=True) only if you trust the file's origin"
_PATH_NAME = re.compile(r"[A-Za-z0-9_]+\Z")


@dataclass
class Pickled:
    """An archive entry whose loading unpickles.

    Attributes:
        record: The entry's name inside the archive (without the root folder).
        kind: ``tensor`` (a ``use_pickle`` weight or constant), ``sample_inputs``, ``custom_obj``,
            ``opaque_obj``, ``legacy``.
        what: What it holds, for messages.
        fqn: The weight/constant it provides ('' for sample inputs and legacy files).
        section: ``weights``, ``constants`` or ``sample_inputs``.
    """

    record: str
    kind: str
    what: str
    fqn: str = ""
    section: str = ""


@dataclass
class Archive:
    """What :func:`inspect_archive` found; ``reader`` stays open for the loader.

    Attributes:
        path: The file.
        reader: torch's ``PT2ArchiveReader`` over the open file.
        program_json: ``models/model.json``, parsed.
        weights: ``model_weights_config.json``'s ``config`` (FQN -> payload dict), {} for legacy files.
        constants: Same for constants.
        pickled: The entries that need unpickling.
        targets: Every node target string of the program (checked by the loader, after ``--import``).
    """

    path: Path
    reader: Any
    handle: Any
    program_json: dict[str, Any]
    weights: dict[str, Any]
    constants: dict[str, Any]
    pickled: list[Pickled] = field(default_factory=list)
    targets: set[str] = field(default_factory=set)

    def close(self) -> None:
        """Close the file."""
        self.handle.close()


def _refuse(path: Path, problem: str, fix: str = _RE_FIX) -> LoadError:
    return LoadError(f"{str(path)!r}: {problem}", fix)


def inspect_archive(path: Path) -> Archive:
    """Check a .pt2's structure and JSON entries; unpickle nothing.

    Raises:
        LoadError: A zip bomb, duplicate or stray entries, a missing, unparsable or off-schema JSON entry,
            weights whose bytes do not match their metadata, or program strings that would be evaluated.
    """
    size = path.stat().st_size
    handle = path.open("rb")
    try:
        records = _check_zip(path, handle, size)
        if f"models/{MODEL}.json" not in records and any(r.startswith("data/aotinductor/") for r in records):
            fix = "run it with torch._inductor.aoti_load_package; amplite commands read --format pt2 output"
            raise _refuse(path, "is an AOTInductor package (compiled code, which amplite never loads)", fix)
        reader = _open_reader(path, handle, records)
        read = _json_reader(path, reader, records)
        program = read(f"models/{MODEL}.json")
        targets = _check_program(path, program)
        pickled: list[Pickled] = []
        if SAMPLE_INPUTS not in records:
            raise _refuse(path, f"the archive has no {SAMPLE_INPUTS}")
        pickled.append(Pickled(SAMPLE_INPUTS, "sample_inputs", "the example inputs", "", "sample_inputs"))
        sections = {}
        for section, base in (("weights", WEIGHTS), ("constants", CONSTANTS)):
            legacy = f"{base}{MODEL}.pt"
            if legacy in records:
                what = f"the {section} in torch's legacy pickled format"
                pickled.append(Pickled(legacy, "legacy", what, "", section))
                sections[section] = {}
                continue
            config = read(f"{base}{MODEL}_{section}_config.json")
            sections[section] = _check_payloads(path, reader, records, config, section, base, pickled)
        return Archive(path, reader, handle, program, sections["weights"], sections["constants"], pickled, targets)
    except LoadError:
        handle.close()
        raise
    except Exception as exc:  # only parsing happens here: any other failure is a malformed file, not a bug
        handle.close()
        raise _refuse(path, f"a malformed archive ({type(exc).__name__}: {' '.join(str(exc).split())[:120]})") from None
    except BaseException:
        handle.close()
        raise


def check_zip(path: Path, *, rooted: bool = True, fix: str = _RE_FIX) -> set[str]:
    """The entry names (without the root folder) of a zip file, after the structural checks.

    Args:
        path: The file.
        rooted: Entries must share one root folder (every torch file does; ``.npz`` files do not).
        fix: The fix to print on refusal.

    Raises:
        LoadError: A corrupt zip, duplicate names, entries outside the root folder, or a zip bomb.
    """
    with path.open("rb") as handle:
        try:
            return _check_zip(path, handle, path.stat().st_size, rooted)
        except LoadError as exc:
            raise LoadError(exc.problem, fix) from None


def check_zip_bytes(label: Path, data: bytes) -> set[str]:
    """:func:`check_zip` for a zip held in memory (a torch.save file inside an archive), named ``label``."""
    return _check_zip(label, io.BytesIO(data), len(data))


def _check_zip(path: Path, handle: Any, size: int, rooted: bool = True) -> set[str]:
    try:
        infos = zipfile.ZipFile(handle).infolist()
    except Exception as exc:  # BadZipFile, NotImplementedError (a version or method field), OSError, ...
        raise _refuse(path, f"a truncated or corrupt zip archive ({exc})") from None
    names = [i.filename for i in infos]
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise _refuse(path, f"two entries are named {name!r} (zip readers disagree on which one is read)")
        seen.add(name)
    declared = sum(i.file_size for i in infos)
    if declared > MAX_EXPANSION * size + SLACK_BYTES:
        raise _refuse(
            path,
            f"its entries claim {declared:,} uncompressed bytes in a {size:,}-byte file (a zip bomb); "
            "torch.export.save stores entries uncompressed",
        )
    if not rooted:
        return set(names)
    root = names[0].split("/", 1)[0] if names else ""
    stray = [n for n in names if not n.startswith(root + "/")]
    if not names or stray:
        raise _refuse(path, f"entries outside the archive's root folder {root!r}: {stray[:3]}")
    return {n[len(root) + 1 :] for n in names}


def _open_reader(path: Path, handle: Any, records: set[str]) -> Any:
    from torch.export.pt2_archive._package import PT2ArchiveReader
    from torch.export.pt2_archive.constants import ARCHIVE_VERSION_PATH, ARCHIVE_VERSION_VALUE

    try:
        handle.seek(0)
        reader = PT2ArchiveReader(handle)
        version = reader.read_string(ARCHIVE_VERSION_PATH)
    except Exception as exc:  # torch raises AssertionError/RuntimeError for foreign archives
        raise _refuse(path, f"not a torch.export archive torch can read ({type(exc).__name__})") from None
    if version != ARCHIVE_VERSION_VALUE:
        raise _refuse(path, f"archive version {version!r}, this torch reads {ARCHIVE_VERSION_VALUE!r}")
    if set(reader.get_file_names()) != records:
        raise _refuse(path, "torch's zip reader and Python's list different entries (a crafted zip directory)")
    return reader


def _json_reader(path: Path, reader: Any, records: set[str]) -> Any:
    def read(record: str) -> dict[str, Any]:
        if record not in records:
            raise _refuse(path, f"the archive has no {record}")
        try:
            value = json.loads(reader.read_bytes(record).decode("utf-8"))
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise _refuse(path, f"{record} is not valid JSON ({str(exc)[:80]})") from None
        if not isinstance(value, dict):
            raise _refuse(path, f"{record} is a JSON {type(value).__name__}, not the object torch writes")
        return value

    return read


def _schema(path: Path, record: str, cls: Any, value: Any) -> Any:
    from torch._export.serde.serialize import _dict_to_dataclass

    try:
        return _dict_to_dataclass(cls, value)
    except Exception as exc:  # torch asserts on shapes it does not expect
        raise _refuse(path, f"{record} does not match torch's schema ({type(exc).__name__}: {str(exc)[:80]})") from None


def _check_payloads(
    path: Path, reader: Any, records: set[str], config: dict[str, Any], section: str, base: str, out: list[Pickled]
) -> dict[str, Any]:
    from torch._export.serde import schema

    record = f"{base}{MODEL}_{section}_config.json"
    entries = config.get("config")
    if not isinstance(entries, dict):
        raise _refuse(path, f"{record} has no 'config' object")
    for fqn, meta in entries.items():
        where = f"{record} entry {fqn!r}"
        if not FQN.match(fqn) or not fqn or not isinstance(meta, dict):
            raise _refuse(path, f"{where} is not a name/payload pair torch writes")
        name = meta.get("path_name")
        if not isinstance(name, str) or not _PATH_NAME.match(name) or base + name not in records:
            raise _refuse(path, f"{where} points at {name!r}, which is not an entry of the archive")
        for key in ("is_param", "use_pickle"):
            if not isinstance(meta.get(key, False), bool):
                raise _refuse(path, f"{where}: {key} is not true/false")
        _schema(path, record, schema.PayloadMeta, meta)
        kind = _payload_kind(path, where, name, meta, section)
        if kind == "tensor" and not meta.get("use_pickle"):
            _check_tensor_bytes(path, where, meta.get("tensor_meta"), reader.archive_file.get_record_size(base + name))
        elif kind == "tensor":
            out.append(Pickled(base + name, "tensor", f"the {section[:-1]} {fqn!r} (use_pickle)", fqn, section))
        else:
            what = "a TorchScript custom object" if kind == "custom_obj" else "an opaque Python object"
            out.append(Pickled(base + name, kind, f"{what} (constant {fqn!r})", fqn, section))
    return entries


def _payload_kind(path: Path, where: str, name: str, meta: dict[str, Any], section: str) -> str:
    from torch.export.pt2_archive.constants import (
        CUSTOM_OBJ_FILENAME_PREFIX,
        OPAQUE_OBJ_FILENAME_PREFIX,
        TENSOR_CONSTANT_FILENAME_PREFIX,
        WEIGHT_FILENAME_PREFIX,
    )

    if section == "weights":
        if not name.startswith(WEIGHT_FILENAME_PREFIX):
            raise _refuse(path, f"{where}: {name!r} is not a weight file name")
        return "tensor"
    for prefix, kind in (
        (TENSOR_CONSTANT_FILENAME_PREFIX, "tensor"),
        (CUSTOM_OBJ_FILENAME_PREFIX, "custom_obj"),
        (OPAQUE_OBJ_FILENAME_PREFIX, "opaque_obj"),
    ):
        if name.startswith(prefix):
            return kind
    raise _refuse(path, f"{where}: {name!r} is not a constant kind torch knows")


def _check_tensor_bytes(path: Path, where: str, meta: Any, nbytes: int) -> None:
    from torch._export.serde.serialize import _SERIALIZE_TO_TORCH_DTYPE

    def ints(values: Any) -> list[int]:
        if not isinstance(values, list) or not all(
            isinstance(v, dict) and set(v) == {"as_int"} and type(v["as_int"]) is int and v["as_int"] >= 0
            for v in values
        ):
            raise _refuse(path, f"{where}: tensor sizes/strides are not non-negative integers")
        return [v["as_int"] for v in values]

    if not isinstance(meta, dict):
        raise _refuse(path, f"{where} has no tensor metadata")
    dtype = _SERIALIZE_TO_TORCH_DTYPE.get(meta.get("dtype"))  # type: ignore[arg-type]
    if dtype is None:
        raise _refuse(path, f"{where}: unknown dtype code {meta.get('dtype')!r}")
    sizes, strides = ints(meta.get("sizes")), ints(meta.get("strides"))
    (offset,) = ints([meta.get("storage_offset")])
    if len(sizes) != len(strides):
        raise _refuse(path, f"{where}: {len(sizes)} sizes but {len(strides)} strides")
    element = dtype.itemsize
    numel = 1
    for s in sizes:
        numel *= s
    need = 0 if numel == 0 else (offset + sum((s - 1) * st for s, st in zip(sizes, strides, strict=True)) + 1) * element
    if nbytes % element or need > nbytes or (nbytes == 0 and numel):
        raise _refuse(
            path,
            f"{where} declares a {dtype} tensor of shape {sizes} (needing {need:,} bytes) but its file holds "
            f"{nbytes:,} bytes",
        )


def _check_program(path: Path, program: dict[str, Any]) -> set[str]:
    from torch._export.serde import schema

    record = f"models/{MODEL}.json"
    targets = check_program_strings(path, record, program)
    _schema(path, record, schema.ExportedProgram, program)
    return targets
