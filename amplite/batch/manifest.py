"""Batch manifests: parse and validate a TOML manifest (or a directory/glob), hash jobs, shard them.

A manifest has an optional ``[defaults]`` table and one ``[[model]]`` table per model; every key of
:data:`JOB_KEYS` may appear in either (``name`` and ``path`` only in ``[[model]]``). Relative paths are
relative to the manifest's directory. See docs/batch.md for the format.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from difflib import get_close_matches
from pathlib import Path
from typing import Any

from amplite.batch.keys_table import (
    JOB_KEYS,
    MODEL_ONLY,
    TOLERANCE_KEYS,
    SubKeyError,
    check_value,
    conversion_keys,
    conversion_problem,
    manifest_values,
)
from amplite.batch.manifest_lines import combined, line_index
from amplite.errors import ConfigError
from amplite.options import ConvertOptions
from amplite.paths import not_a_file
from amplite.verify.compare import Tolerance

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib

#: Every key a ``[[model]]`` or ``[defaults]`` entry may hold, with what it expects (for messages).
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
#: File suffixes taken from a directory source (self-contained: they store their example inputs).


class ManifestError(ConfigError):
    """The manifest (or the batch's source or options) is invalid; the batch does not start."""


@dataclass(frozen=True)
class Job:
    """One model to convert: a model file and its conversion options (one :class:`amplite.ConvertOptions`,
    checked as a spec when the manifest is read, its precision and level fixed then: ``$AMPLITE_LEVEL``, as
    ``amplite convert`` reads it, is part of the resume hash), plus how to find its inputs, what to write and how
    to run the worker. Every other conversion option keeps ``amplite.convert``'s default.

    Attributes:
        name: Output sub-directory name, unique in the batch.
        path: Absolute path of the model file.
        options: The conversion options (``calibration``: the manifest's ``calib`` or ``calib_loader``;
            ``tolerance``: the manifest's table over the precision's default).
        inputs: Input specs ``NAME:SHAPE:DTYPE[lo,hi)``, as keyword inputs.
        inputs_file: An inputs file (absolute).
        seed: Seed of the random inputs.
        formats: Output formats.
        timeout: Seconds for the worker (None: the batch's).
        max_memory_gb: GiB of address space for the worker.
        line: Manifest line of the entry (0 when not from a manifest), for messages.
    """

    name: str
    path: str
    options: ConvertOptions = field(default_factory=ConvertOptions)
    inputs: tuple[str, ...] = ()
    inputs_file: str | None = None
    seed: int = 0
    formats: tuple[str, ...] = ("pt2",)
    timeout: float | None = None
    max_memory_gb: float | None = None
    line: int = field(default=0, compare=False)

    @property
    def calib_dir(self) -> Path | None:
        """The directory of calibration batches (``calib``); None without one, or with a ``calib_loader``."""
        calibration = self.options.calibration
        return calibration if isinstance(calibration, Path) else None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able settings in the manifest's keys (what the worker process receives; :meth:`from_dict`
        reads them back equal): the job's own keys (None: not set, left out), and the conversion options given."""
        own = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "options"}
        own = {k: list(v) if isinstance(v, tuple) else v for k, v in own.items() if v is not None}
        return {**own, **manifest_values(self.options)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, base: Path | None = None) -> Job:
        """A job from a mapping of :data:`JOB_KEYS` (``line`` allowed too), validated.

        Raises:
            ManifestError: Unknown key, wrong type or invalid value.
        """
        data = dict(data)
        line = int(data.pop("line", 0) or 0)
        return make_job(data, base or Path.cwd(), lambda key: line, where="job")


def _fail(where: str, line: int, key: str | None, problem: str, fix: str) -> ManifestError:
    at = f"{where}, line {line}" if line else where
    return ManifestError(f"{at}: {f'{key!r}: ' if key else ''}{problem}", fix)


def make_job(data: dict[str, Any], base: Path, line_of: Any, *, where: str) -> Job:
    """Validate a merged (defaults + entry) mapping into a Job."""
    for key in data:
        if key not in JOB_KEYS:
            raise _fail(
                where,
                line_of(key),
                None,
                f"unknown key {key!r}" + "".join(f", did you mean {m!r}?" for m in get_close_matches(key, JOB_KEYS, 1)),
                f"use one of: {', '.join(JOB_KEYS)} (see docs/batch.md)",
            )
    values: dict[str, Any] = {}
    for key, value in data.items():
        try:
            values[key] = check_value(key, value)
        except ValueError as exc:
            at = line_of(f"{key}.{exc.subkey}") if isinstance(exc, SubKeyError) else line_of(key)
            raise _fail(where, at, key, str(exc), f"give {JOB_KEYS[key]}") from None
    if "path" not in values:
        raise _fail(where, line_of("name"), None, "no 'path'", 'add path = "model.pt2" to the entry')
    path = (base / Path(values["path"]).expanduser()).resolve()
    values["path"] = str(path)
    for key in ("inputs_file", "calib"):
        if key in values:
            values[key] = str((base / Path(values[key]).expanduser()).resolve())
    name = values.get("name") or safe_name(path)
    if not _NAME.match(name):
        raise _fail(
            where, line_of("name"), "name", f"{name!r} is not a valid directory name", JOB_KEYS["name"]
        )
    values["name"] = name
    bad = conversion_problem(values)  # before _options takes the conversion keys out of values
    if bad is not None:
        raise _fail(where, line_of(bad[0]), bad[0], bad[1].problem, bad[1].fix)
    options = _options(values, where, line_of)
    _check_formats(values, where, line_of)
    return Job(values.pop("name"), values.pop("path"), options, **values,
               line=line_of("name") if "name" in data else line_of("path"))  # fmt: skip


def _options(values: dict[str, Any], where: str, line_of: Any) -> ConvertOptions:
    """Take the conversion keys out of ``values`` as one ``ConvertOptions``, checked as ``amplite.convert``
    checks them (:meth:`ConvertOptions.spec`), with the precision and level fixed (for the resume hash)."""
    from amplite.options import calibration_source
    from amplite.verify.compare import DEFAULT_TOLERANCES

    given = {k: values.pop(k) for k in conversion_keys() if k in values}
    table = values.pop("tolerance", None)
    calib, loader = values.pop("calib", None), values.pop("calib_loader", None)
    for key, value in given.items():  # each value alone first: the error names its key and line
        try:
            ConvertOptions(**{key: value}).spec()
        except ConfigError as exc:
            raise _fail(where, line_of(key), key, exc.problem, exc.fix) from None
    try:
        options = ConvertOptions(**given, calibration=calibration_source(calib, loader))
        spec = options.spec()
    except ConfigError as exc:  # values that contradict each other (fp8 at O0, calib and calib_loader)
        both = calib is not None and loader is not None
        key = "calib_loader" if both else "level" if "level" in given else "precision"
        raise _fail(where, line_of(key), None, exc.problem, exc.fix) from None
    tolerance = None
    if table is not None:  # the manifest's thresholds over the precision's default
        default = DEFAULT_TOLERANCES[spec.precision_name]
        tolerance = Tolerance(**{**{k: getattr(default, k) for k in TOLERANCE_KEYS}, **table})
    return replace(options, precision=spec.precision_name, level=spec.level, tolerance=tolerance)


def _check_formats(values: dict[str, Any], where: str, line_of: Any) -> None:
    """Validate output formats with the converter's own check."""
    from amplite.converter import emit

    if "formats" in values and not values["formats"]:  # a job that writes nothing would still say `ok`
        raise _fail(where, line_of("formats"), "formats", "no output format", 'give at least one, e.g. ["pt2"]')
    for fmt in values.get("formats", ("pt2",)):
        try:
            emit.format_for(f"model.{fmt}", fmt)
        except ConfigError as exc:
            raise _fail(where, line_of("formats"), "formats", exc.problem, exc.fix) from None


def safe_name(path: Path) -> str:
    """A directory-safe model name from a file name: ``bert.fp32.pt2`` -> ``bert.fp32``."""
    stem = path.name[: -len(path.suffix)] if path.suffix else path.name
    return re.sub(r"[^A-Za-z0-9_.-]", "_", stem).lstrip(".") or "model"


#: Manifest keys that name Python code amplite imports and runs (from the working directory too): a manifest
#: may set them only when the batch is started with ``--trust-code`` (``trust_code=True``).
CODE_KEYS = ("model_factory", "import_modules", "calib_loader")


def parse_manifest(
    path: str | Path, defaults: Mapping[str, Any] | None = None, *, trust_code: bool = False
) -> list[Job]:
    """Read a TOML manifest into jobs.

    Args:
        path: The manifest file.
        defaults: Settings under the manifest's ``[defaults]`` (e.g. CLI options); the manifest wins.
        trust_code: Allow the manifest's own :data:`CODE_KEYS` (code it names is imported and run). The
            same keys given in ``defaults`` (CLI options: the user's own choice) need no opt-in.

    Raises:
        ManifestError: Unreadable TOML, unknown keys (naming key and line), bad values, duplicate names,
            a code key without ``trust_code``, or unpickling without the CLI's ``--trust-pickle``.
    """
    p = Path(path)
    problem = not_a_file(p)
    if problem is not None:
        raise ManifestError(f"manifest {str(p)!r} {problem}", "pass the path of a .toml manifest")
    text = p.read_text(encoding="utf-8")
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(f"{p}: invalid TOML: {exc}", "fix the syntax at that line") from None
    where = str(p)
    index = line_index(text)
    top = index(None)
    for key in doc:
        if key not in ("defaults", "model"):
            line = next(
                (
                    i
                    for i, ln in enumerate(text.splitlines(), 1)
                    if re.match(r"^\s*(\[\[?\s*)?[\"']?" + re.escape(key) + r"\b", ln)
                ),
                0,
            )
            raise _fail(
                where,
                line,
                None,
                f"unknown top-level key {key!r}",
                "use a [defaults] table and [[model]] entries (see docs/batch.md)",
            )
    shared = doc.get("defaults", {})
    if not isinstance(shared, dict):
        raise _fail(where, 0, "defaults", "must be a table", "write [defaults] followed by key = value lines")
    for key in MODEL_ONLY:
        if key in shared:
            raise _fail(where, top(key), key, "is per model, not a default", "move it into a [[model]] entry")
    entries = doc.get("model", [])
    if not isinstance(entries, list) or not entries:
        raise ManifestError(f"{where}: no [[model]] entries", "add one [[model]] table per model")
    base = p.resolve().parent
    jobs = []
    for i, entry in enumerate(entries):
        line_of = index(i)
        if not isinstance(entry, dict):
            raise _fail(where, 0, "model", f"entry #{i + 1} is a {type(entry).__name__}, not a table",
                        "write each model as a [[model]] table of key = value lines")  # fmt: skip
        if not trust_code:
            _refuse_code(where, shared, entry, line_of, top)
        jobs.append(
            make_job(
                {**(defaults or {}), **shared, **entry}, base, combined(line_of, top, entry), where=where
            )
        )
    check_unique(jobs, where)
    confirmed = bool((defaults or {}).get("trust_pickle"))
    for job in jobs:
        if job.options.trust_pickle and not confirmed:  # a manifest is a file like the models: it cannot opt in alone
            raise ManifestError(
                f"{where}: model {job.name!r} sets trust_pickle = true (line {job.line}); unpickling runs code "
                "from its model file",
                "pass --trust-pickle to `amplite batch` as well, only if you trust the models",
            )
    return jobs


def _refuse_code(where: str, shared: Mapping[str, Any], entry: Mapping[str, Any], line_of: Any, top: Any) -> None:
    for key in CODE_KEYS:
        if key in entry or key in shared:
            line = line_of(key) if key in entry else top(key)
            raise _fail(where, line, key, f"names Python code ({(entry if key in entry else shared)[key]!r}) that "
                        "amplite would import and run, from the working directory too",
                        "pass --trust-code to `amplite batch` (trust_code=True) only if you trust the manifest "
                        "and the code it names")  # fmt: skip


def check_unique(jobs: Sequence[Job], where: str = "batch") -> None:
    """Raise ManifestError if two jobs share a name (their outputs would collide)."""
    seen: dict[str, Job] = {}
    for job in jobs:
        if job.name in seen:
            first = seen[job.name]
            lines = f" (lines {first.line} and {job.line})" if job.line else ""
            raise ManifestError(
                f"{where}: duplicate model name {job.name!r}{lines}",
                'give each [[model]] a unique name = "..."',
            )
        seen[job.name] = job
