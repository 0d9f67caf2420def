"""The architecture's rules hold: layers (import-linter) and one definition of the conversion options."""

from __future__ import annotations

import inspect
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import amplite
from amplite.cli.options import CONVERSION_PARAMS

ROOT = Path(__file__).resolve().parents[1]
# convert() keywords that are not conversion options of the CLI: inputs, verification and search controls,
# and library-only arguments (Python objects).
NOT_CLI_OPTIONS = {
    "model", "example_inputs", "verify", "tolerance", "calibration", "fallback_search", "max_trials",
    "reference_outputs", "fold_batchnorm",
}  # fmt: skip


def test_import_linter_contracts_are_kept() -> None:
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("import-linter is not installed (it is in the dev extra)")
    proc = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "broken" in proc.stdout and "0 broken" in proc.stdout


def test_every_convert_keyword_is_a_cli_conversion_option() -> None:
    api = set(inspect.signature(amplite.convert).parameters) - NOT_CLI_OPTIONS
    cli = {p.name for p in CONVERSION_PARAMS} - {"no_fold_batchnorm"}
    assert api == cli, f"only in the API: {sorted(api - cli)}; only in the CLI: {sorted(cli - api)}"


@pytest.mark.parametrize("command", ["convert", "inspect", "check"])
def test_every_converting_command_accepts_every_conversion_option(command: str) -> None:
    from typer.main import get_command

    from amplite.cli import app

    click_cmd = get_command(app).commands[command]  # type: ignore[attr-defined]
    flags = {opt for p in click_cmd.params for opt in [*p.opts, *p.secondary_opts]}
    for param in CONVERSION_PARAMS:
        info = param.annotation.__metadata__[0]
        # With Annotated, typer keeps the first flag in `default` (e.g. --import for import_modules).
        first = (info.default,) if isinstance(info.default, str) and info.default.startswith("-") else ()
        declared = info.param_decls or first or (f"--{param.name.replace('_', '-')}",)
        for flag in declared:
            for part in flag.split("/"):
                assert part in flags, f"`amplite {command}` lacks {part}"
