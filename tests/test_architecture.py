"""The architecture's rules hold: layers (import-linter) and one definition of the conversion options."""

from __future__ import annotations

import inspect
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import amplite
from amplite import ConvertOptions
from amplite.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
DESCRIBED = ConvertOptions.described()
WITH_FLAGS = [name for name, o in DESCRIBED.items() if o.flags]
IN_MANIFEST = [name for name, o in DESCRIBED.items() if o.kind not in ("none", "tolerance")]


def test_import_linter_contracts_are_kept() -> None:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert exe is not None, "lint-imports not found next to this Python: install the dev extra (make install)"
    proc = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "broken" in proc.stdout and "0 broken" in proc.stdout


def _cli_sample(name: str) -> tuple[list[str], object]:
    """CLI arguments giving option ``name`` a non-default value, and the value ``ConvertOptions`` must hold."""
    o = DESCRIBED[name]
    flag = o.flags[0].split("/")
    if o.cli_type is bool:  # a plain flag, or --x/--no-x whose default is True
        return ([flag[-1]] if o.cli_default else [flag[0]]), not o.cli_default
    if o.cli_type == bool | None:
        return [flag[0]], True
    if o.cli_type == list[str]:
        return [flag[0], "a:1", flag[0], "b:2"], ("a:1", "b:2")
    if o.cli_type in (int, int | None):
        return [flag[0], "7"], 7
    if o.cli_type in (float, float | None):
        return [flag[0], "99.5"], 99.5
    return [flag[0], "x9"], "x9"


@pytest.mark.parametrize("command", ["convert", "inspect", "check"])
@pytest.mark.parametrize("name", WITH_FLAGS)
def test_each_cli_flag_reaches_the_options_of_every_converting_command(cli, monkeypatch, tmp_path: Path,
                                                                        command: str, name: str) -> None:  # fmt: skip
    """A field of ConvertOptions with flags is an option of every converting command, and its value arrives in
    the ``ConvertOptions`` the library call receives (nothing lists the options by name)."""
    import amplite.gate
    import amplite.save

    seen: list[ConvertOptions] = []

    def capture(*args: object, options: ConvertOptions, **kwargs: object) -> None:
        seen.append(options)
        raise ConfigError("captured", "none")

    target = {"convert": (amplite.save, "convert_to_files"), "inspect": (amplite.api, "convert"),
              "check": (amplite.gate, "check")}[command]  # fmt: skip
    monkeypatch.setattr(*target, capture)
    args, want = _cli_sample(name)
    res = cli(command, tmp_path / "m.pt2", *args)
    assert res.exit_code == 2 and "captured" in res.stderr, res.stderr  # type: ignore[attr-defined]
    (got,) = seen
    assert getattr(got, name) == want
    assert set(got.given()) == {name}  # every other option stayed at the API's default


def test_golden_takes_exactly_the_options_of_the_fp32_reference(cli) -> None:
    from typer.main import get_command

    from amplite.cli import app

    flags = {o for p in get_command(app).commands["golden"].params for o in p.opts}  # type: ignore[attr-defined]
    reference = {n for n in WITH_FLAGS if "reference" in DESCRIBED[n].paths}
    assert reference == {"trust_pickle", "model_factory", "import_modules", "dynamic_batch", "dynamic_dims"}
    for name in WITH_FLAGS:
        first = DESCRIBED[name].flags[0].split("/")[0]
        assert (first in flags) == (name in reference), name


def test_the_convert_signature_lists_every_option_and_refuses_unknown_ones() -> None:
    params = inspect.signature(amplite.convert).parameters
    for name in ConvertOptions.names():
        assert params[name].default == ConvertOptions.default(name), name
    with pytest.raises(ConfigError, match=r"unknown conversion option.*levl"):
        amplite.convert(None, None, levl="O2")
    with pytest.raises(ConfigError, match="options= is a dict, not ConvertOptions"):
        amplite.convert(None, None, options={"level": "O2"})
    with pytest.raises(ConfigError, match="settings= is a dict, not CheckSettings"):
        amplite.check(None, None, settings={"golden": "x"})


def test_options_keywords_override_the_value_and_the_value_is_not_changed() -> None:
    base = ConvertOptions(precision="bf16", level="O2")
    merged = ConvertOptions.of(base, level="O1", keep_fp32=("op:softmax",))
    assert (merged.precision, merged.level, merged.keep_fp32) == ("bf16", "O1", ("op:softmax",))
    assert (base.level, base.keep_fp32) == ("O2", ())
    assert merged.spec().level.value == "O1" and merged.spec().precision is torch.bfloat16


def _manifest_sample(name: str) -> tuple[str, object]:
    """A TOML value for manifest key ``name`` (not its default) and what the worker's options must hold."""
    kind = DESCRIBED[name].kind
    if kind == "bool":
        default = ConvertOptions.default(name)
        return ("false", False) if default is True else ("true", True)
    if kind == "list":
        return '["a:1"]', ("a:1",)
    if kind == "level":
        return '"O2"', "O2"
    if kind == "count":
        return "7", 7
    if kind == "number":
        return "99.5", 99.5
    # values the manifest reader checks (a GPU profile must exist) take a valid one; the rest any string
    return {"precision": ('"bf16"', "bf16"), "gpu_profile": ('"A100"', "A100")}.get(name, ('"x9"', "x9"))


@pytest.mark.parametrize("name", IN_MANIFEST)
def test_each_manifest_conversion_key_reaches_the_workers_options(tmp_path: Path, monkeypatch, name: str) -> None:
    """Every ConvertOptions field with a manifest kind is a ``[defaults]`` key, and the worker converts with it."""
    import amplite.api
    from amplite.batch.manifest import parse_manifest
    from amplite.batch.worker import convert_job

    seen: list[ConvertOptions] = []

    def capture(model: object, inputs: object, *, options: ConvertOptions) -> None:
        seen.append(options)
        raise ConfigError("captured", "none")

    monkeypatch.setattr(amplite.api, "convert", capture)
    (tmp_path / "m.pt2").write_bytes(b"")
    text, want = _manifest_sample(name)
    (tmp_path / "batch.toml").write_text(f'[defaults]\n{name} = {text}\n[[model]]\npath = "m.pt2"\n')
    # the command line confirms what a manifest may not opt into alone (code to run, unpickling)
    (job,) = parse_manifest(tmp_path / "batch.toml", {"trust_pickle": True}, trust_code=True)
    row = convert_job(job.to_dict(), tmp_path)
    assert "captured" in str(row), row
    assert getattr(seen[0], name) == want


def test_calibration_has_two_outside_spellings(tmp_path: Path) -> None:
    """``--calib DIR`` and ``--calib-loader module:function`` (manifest ``calib``/``calib_loader``) both become
    ``calibration``; both at once is an error."""
    from amplite.batch.worker import convert_job  # noqa: F401  (the worker reads them the same way)
    from amplite.options import calibration_source

    assert calibration_source(str(tmp_path), None) == tmp_path
    assert calibration_source(None, "pkg.mod:batches") == "pkg.mod:batches"
    with pytest.raises(ConfigError, match="both given"):
        calibration_source(str(tmp_path), "pkg.mod:batches")
