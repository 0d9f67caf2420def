"""``amplite check``'s options are ``CheckSettings``' fields and ``ConvertOptions``' flags, from one definition."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import typer

import amplite.api
import amplite.gate
from amplite.cli import app
from amplite.cli.gate import API_ONLY, NOT_SETTINGS, RENAMED, check_settings
from amplite.cli.options import CONVERSION_PARAMS
from amplite.errors import ConfigError, InternalError
from amplite.gate import CheckSettings


def _check_params() -> set[str]:
    command = typer.main.get_command(app).commands["check"]  # type: ignore[attr-defined]
    return {p.name for p in command.params}


def test_check_parameters_are_the_gate_settings_and_the_conversion_options() -> None:
    params = _check_params()
    conversion = {p.name for p in CONVERSION_PARAMS}
    assert conversion <= params, f"conversion options missing from check: {sorted(conversion - params)}"
    own = params - conversion - set(NOT_SETTINGS)
    as_fields = {RENAMED.get(name, (name, None))[0] for name in own}
    wanted = {f.name for f in fields(CheckSettings)} - set(API_ONLY)
    assert as_fields == wanted, (
        f"check options that are no CheckSettings field: {sorted(as_fields - wanted)}; "
        f"fields without a check option: {sorted(wanted - as_fields)}"
    )
    assert not set(RENAMED) - params, "RENAMED names a parameter check does not have"


def test_every_check_flag_reaches_the_gate_settings(cli: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: list[CheckSettings] = []

    def fake_check(model: Any, example: Any, *, settings: Any = None, options: Any = None, **changes: Any) -> Any:
        seen.append(CheckSettings.split(settings, options, changes)[0])
        raise ConfigError("stop here", "nothing to fix")

    monkeypatch.setattr(amplite.gate, "check", fake_check)
    monkeypatch.setattr(amplite.api, "example_inputs", lambda specs, inputs_file: None)
    res = cli(
        "check", tmp_path / "m.pt2", "--converted", tmp_path / "c.pt2", "--golden", tmp_path / "g",
        "--update-golden", "--baseline", tmp_path / "b.json", "--baseline-margin", "2.5",
        "--tolerance", "sqnr>=40", "--data", tmp_path / "d", "--data-loader", "m:f", "--random-batches", "3",
        "--max-batches", "5", "--no-layerwise", "--grad", "--loss", "m:loss", "--report", tmp_path / "r",
        "--junit", tmp_path / "j.xml", "--name", "net", "--train-steps", "2", "--lr", "0.5",
        "--input", "x:2x3:float32", "--inputs", tmp_path / "in.pt",
    )  # fmt: skip
    assert res.exit_code == 2 and len(seen) == 1
    got, default = seen[0], CheckSettings()
    unset = [f.name for f in fields(CheckSettings) if getattr(got, f.name) == getattr(default, f.name)]
    assert not unset, f"flags given but left at the default: {unset}"
    assert got.baseline_margin_db == 2.5 and got.layerwise is False and got.lr == 0.5
    assert list(got.tolerance or ()) == ["sqnr>=40"] and list(got.input_specs) == ["x:2x3:float32"]
    assert Path(got.report_dir or "") == tmp_path / "r" and Path(got.inputs_file or "") == tmp_path / "in.pt"


def test_check_settings_refuses_a_parameter_or_field_the_other_lacks() -> None:
    full = {f.name: f.default for f in fields(CheckSettings)}
    full.update(baseline_margin=1.0, no_layerwise=False, report=None, input=[], inputs=None, tolerance=[])
    for field in ("baseline_margin_db", "layerwise", "report_dir", "input_specs", "inputs_file"):
        del full[field]
    assert check_settings(full) == CheckSettings()
    with pytest.raises(InternalError, match="'bogus'"):
        check_settings({**full, "bogus": 1})
    with pytest.raises(InternalError, match="lr"):
        check_settings({k: v for k, v in full.items() if k != "lr"})
