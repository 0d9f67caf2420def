"""The architecture's rules hold: layers (import-linter) and one definition of the conversion options."""

from __future__ import annotations

import inspect
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import amplite
from amplite.cli.options import API_NAMES, CONVERSION_PARAMS, LOADING_PARAMS

ROOT = Path(__file__).resolve().parents[1]
# convert() keywords that are not conversion options of the CLI: inputs, verification and search controls,
# and library-only arguments (Python objects).
NOT_CLI_OPTIONS = {
    "model", "example_inputs", "verify", "tolerance", "fallback_search", "max_trials", "reference_outputs",
}  # fmt: skip


def test_import_linter_contracts_are_kept() -> None:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert exe is not None, "lint-imports not found next to this Python: install the dev extra (make install)"
    proc = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "broken" in proc.stdout and "0 broken" in proc.stdout


def test_every_convert_keyword_is_a_cli_conversion_option() -> None:
    api = set(inspect.signature(amplite.convert).parameters) - NOT_CLI_OPTIONS
    cli = {API_NAMES.get(p.name, p.name) for p in CONVERSION_PARAMS}
    assert api == cli, f"only in the API: {sorted(api - cli)}; only in the CLI: {sorted(cli - api)}"


@pytest.mark.parametrize(
    ("command", "params"),
    [("convert", CONVERSION_PARAMS), ("inspect", CONVERSION_PARAMS), ("check", CONVERSION_PARAMS),
     ("golden", LOADING_PARAMS)],
)  # fmt: skip
def test_every_converting_command_accepts_every_conversion_option(command: str, params: tuple) -> None:
    from typer.main import get_command

    from amplite.cli import app

    click_cmd = get_command(app).commands[command]  # type: ignore[attr-defined]
    flags = {opt for p in click_cmd.params for opt in [*p.opts, *p.secondary_opts]}
    for param in params:
        info = param.annotation.__metadata__[0]
        # with Annotated, typer keeps the first flag in ``default`` and the rest in ``param_decls``
        first = (info.default,) if isinstance(info.default, str) and info.default.startswith("-") else ()
        declared = (*first, *info.param_decls) or (f"--{param.name.replace('_', '-')}",)
        for flag in declared:
            for part in flag.split("/"):
                assert part in flags, f"`amplite {command}` lacks {part}"


def test_golden_takes_every_option_the_reference_export_uses() -> None:
    """``golden`` exports the FP32 model like ``check --converted`` does: the same loading keywords."""
    from amplite import gate

    assert {p.name for p in LOADING_PARAMS} == set(gate.LOAD_KEYS)


def test_batch_manifest_defaults_accept_every_conversion_option(tmp_path: Path) -> None:
    """A ``[defaults]`` table may set every option ``amplite convert`` has (the same names, minus the CLI's
    ``no_`` spelling: ``fold_batchnorm = false``)."""
    from amplite.batch.keys_table import CONVERT_KEYS, JOB_KEYS
    from amplite.batch.manifest import parse_manifest

    cli = {p.name for p in CONVERSION_PARAMS} - {"no_fold_batchnorm"} | {"fold_batchnorm", "verify"}
    assert cli <= set(JOB_KEYS), sorted(cli - set(JOB_KEYS))
    api = set(inspect.signature(amplite.convert).parameters)
    assert set(CONVERT_KEYS) <= api, sorted(set(CONVERT_KEYS) - api)
    (tmp_path / "calib").mkdir()
    (tmp_path / "m.pt2").write_bytes(b"")
    (tmp_path / "batch.toml").write_text(
        "[defaults]\n"
        'dynamic_dims = ["ids:1"]\nrange_rules = false\ndata_max = 100.0\nmax_reduction_depth = 64\n'
        'fold_batchnorm = false\ncalib = "calib"\nlow_precision_io = true\nfuse_contractions = true\n'
        '[[model]]\npath = "m.pt2"\n'
    )
    (job,) = parse_manifest(tmp_path / "batch.toml")
    assert (job.dynamic_dims, job.range_rules, job.data_max, job.max_reduction_depth, job.fold_batchnorm) == (
        ("ids:1",), False, 100.0, 64, False)  # fmt: skip
    assert job.calib == str((tmp_path / "calib").resolve())
