"""Issue 27, found by amplite's own fuzzer: strings and structure of a .pt2 that FX writes into generated code.

``ExportedProgram.module()`` generates ``forward`` as Python source from the program's calling convention (the
argument names and the keyword names of its input spec) and compiles it. The fuzzer's long run found files
whose names reached that source (a SyntaxError inside torch: exit 3), and call graphs of the wrong shape that
failed there too. amplite checks both before torch generates anything; names the operating system refuses
(a 5,000-character shard or output name) are one-line exit-2 errors, never "internal error".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from amplite.errors import LoadError
from amplite.reading.pt2 import load_program
from tests.test_security import P, json_edit, rebuild
from tests.test_security_design import assert_refused_call, run_cli_many


class WithKeyword(torch.nn.Module):
    def forward(self, x: torch.Tensor, *, y: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) + y


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("codegen") / "kw.pt2"
    ep = torch.export.export(WithKeyword(), (torch.randn(2, 3),), {"y": torch.randn(2, 3)})
    torch.export.save(ep, str(path))
    return path


def _signature(edit):
    def apply(doc: dict) -> None:
        edit(doc["graph_module"]["module_call_graph"][0]["signature"], doc["graph_module"]["module_call_graph"])

    return json_edit(apply)


def _keyword_name(name: str):
    def edit(sig: dict, graph: list) -> None:
        spec = json.loads(sig["in_spec"])
        spec[1]["children_spec"][1]["context"] = json.dumps([name])
        sig["in_spec"] = json.dumps(spec)

    return edit


def _arg_names(value):
    def edit(sig: dict, graph: list) -> None:
        sig["forward_arg_names"] = value

    return edit


def _root_fqn(value):
    def edit(sig: dict, graph: list) -> None:
        graph[0]["fqn"] = value

    return edit


def test_torch_writes_the_files_keyword_names_into_generated_source(base: Path, tmp_path: Path) -> None:
    """The threat: the text of the file becomes Python source that torch compiles."""
    payload = "y':y, 'z':__import__('os').getpid(), 'w"
    path = rebuild(base, tmp_path / "kw.pt2", {P: _signature(_keyword_name(payload))})
    assert "__import__('os').getpid()" in torch.export.load(str(path)).module().code
    with pytest.raises(LoadError, match="in_spec: the key"):
        load_program(path)


CASES = {
    "keyword name leaves its string literal": (_keyword_name("y':0, 'z"), "holds quotes"),
    "keyword name is not an identifier": (_keyword_name("not-a-name"), "is not an identifier"),
    "argument name is code": (_arg_names(["x", "y=__import__('os').getpid()"]), "is not a parameter name"),
    "argument names are not a list": (_arg_names(7), "argument names are not distinct identifiers"),
    "argument names repeat": (_arg_names(["x", "x"]), "argument names are not distinct identifiers"),
    "root entry renamed": (_root_fqn("9223372036854775808"), "no root entry"),
    "root entry not a string": (_root_fqn(12), "no root entry"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_calling_convention_is_checked_before_fx_generates_code(name: str, base: Path, tmp_path: Path) -> None:
    edit, needle = CASES[name]
    path = rebuild(base, tmp_path / "bad.pt2", {P: _signature(edit)})
    with pytest.raises(LoadError, match=needle):
        load_program(path)


@pytest.fixture(scope="module")
def cli_calls(base: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, dict[str, Any]]]:
    """The CLI calls of the two tests below in ONE fresh memory-limited process (run_cli_many): (folder, results)."""
    tmp_path = tmp_path_factory.mktemp("codegen_cli")
    marker = tmp_path / "pwned"
    payload = f"y':y, 'z':__import__('pathlib').Path({str(marker)!r}).touch(), 'w"
    path = rebuild(base, tmp_path / "kw.pt2", {P: _signature(_keyword_name(payload))})
    long = "a" * 5000
    calls: dict[str, list[object]] = {
        "payload": ["convert", path, "-o", tmp_path / "out.pt2"],
        "long-convert": ["convert", base, "-o", tmp_path / f"{long}.pt2"],
        "long-inspect": ["inspect", tmp_path / f"{long}.pt2"],
    }
    return tmp_path, run_cli_many(calls, tmp_path)


def test_cli_refuses_a_generated_code_payload_in_one_line(cli_calls: tuple) -> None:
    tmp_path, got = cli_calls
    assert_refused_call(got, "payload", "in_spec")  # within 60 s
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "out.pt2").exists()


def test_the_untouched_file_still_loads_and_runs(base: Path) -> None:
    program = load_program(base)
    x, y = torch.randn(2, 3), torch.randn(2, 3)
    torch.testing.assert_close(program.module()(x, y=y), torch.relu(x) + y)


def test_names_the_os_refuses_are_input_errors(cli_calls: tuple) -> None:
    tmp_path, got = cli_calls
    long = "a" * 5000
    assert_refused_call(got, "long-convert", "File name too long")
    err = got["long-convert"]["err"]
    assert f"{len(str(tmp_path / long)) + 4} characters)" in err
    assert len(err) < 400  # the name is shortened, the line stays readable
    res = got["long-inspect"]
    assert res["rc"] == 2 and "internal error" not in res["err"]


def test_checkpoint_index_naming_an_impossible_shard_is_refused(tmp_path: Path) -> None:
    from amplite.checkpoint.source import open_checkpoint

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama"}))
    index = {"weight_map": {"lm_head.weight": "x" * 5000 + ".safetensors"}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(LoadError, match="cannot be a file here"):
        open_checkpoint(ckpt)


def test_inputs_zip_of_an_unsupported_version_is_refused(tmp_path: Path) -> None:
    """zipfile raises NotImplementedError for a 'version needed to extract' it lacks (fuzzer, inputs target)."""
    import io
    import struct
    import zipfile

    from amplite.errors import AmpliteError
    from amplite.reading.input_files import read_input_file

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("x.npy", b"\x93NUMPY")
    data = bytearray(buf.getvalue())
    at = data.index(b"PK\x01\x02")
    data[at + 6 : at + 8] = struct.pack("<H", 133)  # version 13.3
    path = tmp_path / "inputs.pt"
    path.write_bytes(bytes(data))
    with pytest.raises(AmpliteError, match=r"zip file version 13\.3"):
        read_input_file(path)


def test_torch_error_logs_stay_quiet_before_the_one_line_error(capfd: pytest.CaptureFixture[str]) -> None:
    """torch logs a failing meta kernel at ERROR, traceback included, before it raises (fuzzer, pt2 target)."""
    import logging

    from amplite.cli.app import _logging

    inner = logging.getLogger("torch._subclasses.fake_tensor")
    with _logging(debug=False):
        assert not inner.isEnabledFor(logging.CRITICAL)
        inner.error("failed while attempting to run meta for aten.ge")
    assert "failed while attempting" not in capfd.readouterr().err
    with _logging(debug=True):  # --debug shows it
        assert inner.isEnabledFor(logging.WARNING)
    assert inner.isEnabledFor(logging.WARNING)  # torch's own level is back afterwards
