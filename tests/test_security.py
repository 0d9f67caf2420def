"""Hostile model files: every way a .pt2 runs code or exhausts memory in torch's loader is refused (issue 18).

Each archive is built from a real ``torch.export.save`` file. For the code-running ones the test first shows
that plain ``torch.export.load`` does run the payload (a marker file appears), then that amplite refuses the
file from the API and the CLI with exit 2, one line, no traceback, no marker and nothing written.
"""

from __future__ import annotations

import io
import json
import pickle
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import amplite
from amplite.errors import AmpliteError, LoadError
from amplite.reading.pt2 import load_program

pytestmark = pytest.mark.filterwarnings("ignore:Duplicate name")
ROOT = Path(__file__).resolve().parents[1]


class Payload:
    """Unpickling this object writes the marker file: a stand-in for arbitrary code execution."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",))


class Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.register_buffer("shift", torch.ones(3))
        self.const = torch.tensor([1.0, 2.0, 3.0])  # a tensor constant: the constants config is not empty

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) + self.shift + self.const


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("base") / "small.pt2"
    torch.manual_seed(0)
    torch.export.save(torch.export.export(Small().eval(), (torch.randn(2, 4),)), str(path))
    return path


def rebuild(src: Path, dst: Path, edits: dict[str, Callable[[bytes], bytes | None]], add=()) -> Path:
    """Copy archive ``src`` to ``dst``, editing entries (None drops one) and appending ``add`` (name, bytes)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        root = zin.namelist()[0].split("/", 1)[0]
        for info in zin.infolist():
            record = info.filename[len(root) + 1 :]
            data = zin.read(info)
            if record in edits:
                data = edits[record](data)
            if data is not None:
                zout.writestr(info.filename, data)
        for record, data in add:
            if callable(data):  # streamed and deflated (the zip bomb)
                info = zipfile.ZipInfo(f"{root}/{record}")
                info.compress_type = zipfile.ZIP_DEFLATED
                with zout.open(info, "w", force_zip64=True) as f:
                    data(f)
            else:
                zout.writestr(zipfile.ZipInfo(f"{root}/{record}"), data)
    return dst


def saved(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def json_edit(fn: Callable[[dict], None]) -> Callable[[bytes], bytes]:
    def edit(data: bytes) -> bytes:
        doc = json.loads(data)
        fn(doc)
        return json.dumps(doc).encode()

    return edit


W = "data/weights/model_weights_config.json"
C = "data/constants/model_constants_config.json"
P = "models/model.json"
CD = "data/constants/"
W0, C0 = "data/weights/weight_0", f"{CD}tensor_0"


def _resize(fqn: str, sizes: list[int]) -> Callable[[dict], None]:
    return lambda doc: doc["config"][fqn]["tensor_meta"].update(sizes=[{"as_int": n} for n in sizes])


def _set(fqn: str, **values: object) -> Callable[[bytes], bytes]:
    return json_edit(lambda doc: doc["config"][fqn].update(values))


def _add_obj(name: str) -> Callable[[dict], None]:
    meta = {"path_name": name, "is_param": False, "use_pickle": True, "tensor_meta": None}
    return lambda doc: doc["config"].update({"obj": meta})


def _first_size(expr: str) -> Callable[[dict], None]:
    def edit(doc: dict) -> None:
        values = doc["graph_module"]["graph"]["tensor_values"]
        values["x"]["sizes"][0] = {"as_expr": {"expr_str": expr, "hint": {"as_int": 2}}}

    return edit


def _node(key: str, value: str) -> Callable[[dict], None]:
    return lambda doc: doc["graph_module"]["graph"]["nodes"][0].update({key: value})


def _bomb(f: io.BufferedIOBase) -> None:
    zeros = bytes(1 << 20)
    for _ in range(100):  # 100 MiB of zeros deflate to ~100 KiB
        f.write(zeros)


def _inner_bomb(data: bytes) -> bytes:
    """The sample inputs (a torch.save zip, stored in the archive) with a deflated bomb inside."""
    buf = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as zin, zipfile.ZipFile(buf, "w") as zout:
        for info in zin.infolist():
            zout.writestr(info, zin.read(info))
        info = zipfile.ZipInfo(f"{zin.namelist()[0].split('/')[0]}/bomb")
        info.compress_type = zipfile.ZIP_DEFLATED
        with zout.open(info, "w", force_zip64=True) as f:
            _bomb(f)
    return buf.getvalue()


def hostile(case: str, base: Path, d: Path, marker: Path) -> Path:
    """Build the hostile archive ``case`` in ``d``."""
    evil = Payload(marker)
    where = d / f"{case}.pt2"
    touch = f"__import__('pathlib').Path({str(marker)!r}).touch()"
    recipes: dict[str, tuple] = {
        "sample_inputs": ({"data/sample_inputs/model.pt": lambda _: saved(((evil,), {}))},),
        "pickled_weight": ({W: _set("lin.weight", use_pickle=True), W0: lambda _: saved(evil)},),
        "pickled_constant": ({C: _set("const", use_pickle=True), C0: lambda _: saved(evil)},),
        "custom_object": ({C: json_edit(_add_obj("custom_obj_0"))}, [(f"{CD}custom_obj_0", saved(evil))]),
        "opaque_object": ({C: json_edit(_add_obj("opaque_obj_0"))}, [(f"{CD}opaque_obj_0", pickle.dumps(evil))]),
        "legacy_constants": ({}, [("data/constants/model.pt", saved(evil))]),
        "sympy_eval": ({P: json_edit(_first_size(touch))},),
        "guard_exec": ({P: json_edit(lambda doc: doc.update(guards_code=[f"{touch} is None"]))},),
        "zip_bomb": ({}, [("extra/bomb", _bomb)]),
        "nested_zip_bomb": ({"data/sample_inputs/model.pt": _inner_bomb},),
        "duplicate_entry": ({}, [("data/sample_inputs/model.pt", saved(((evil,), {})))]),
        "bad_json": ({W: lambda _: b"{not json"},),
        "bad_schema": ({C: lambda _: b'{"config": {"const": {"path_name": "tensor_0", "is_param": "yes"}}}'},),
        "size_mismatch": ({W: json_edit(_resize("lin.weight", [3000, 4]))},),
        "node_target": ({P: json_edit(_node("target", "torch.os.system"))},),
        "node_name": ({P: json_edit(_node("name", "linear = __import__('os')"))},),
    }
    edits, *rest = recipes[case]
    return rebuild(base, where, edits, *rest)


CASES = {
    "sample_inputs": "example inputs with pickled Python objects",
    "pickled_weight": "the weight 'lin.weight' (use_pickle) with pickled Python objects",
    "pickled_constant": "the constant 'const' (use_pickle) with pickled Python objects",
    "custom_object": "a TorchScript custom object",
    "opaque_object": "an opaque Python object",
    "legacy_constants": "legacy pickled format",
    "sympy_eval": "the size expression",
    "zip_bomb": "zip bomb",
    "nested_zip_bomb": "model.pt': its entries claim",
    "duplicate_entry": "two entries are named",
    "bad_json": "is not valid JSON",
    "bad_schema": "is_param is not true/false",
    "size_mismatch": "declares a torch.float32 tensor of shape [3000, 4]",
    "node_target": "'torch.os.system', which is not an operator",
    "node_name": "is not an identifier",
}
PICKLES = ("sample_inputs", "pickled_weight", "pickled_constant", "custom_object", "opaque_object", "legacy_constants")


@pytest.mark.parametrize("case", ["sample_inputs", "pickled_weight", "pickled_constant", "opaque_object",
                                  "legacy_constants", "sympy_eval", "guard_exec"])  # fmt: skip
def test_plain_torch_export_load_runs_the_payload(case: str, base: Path, tmp_path: Path) -> None:
    """The threat is real: torch's own loader runs each of these (so amplite must not call it)."""
    marker = tmp_path / "pwned"
    path = hostile(case, base, tmp_path, marker)
    try:
        ep = torch.export.load(str(path))
        ep.module()(torch.randn(2, 4))
    except Exception:
        pass  # the payload ran before torch noticed the file was odd (or it did not, which fails below)
    assert marker.exists(), f"torch.export.load did not run the {case} payload: the test builds it wrongly"


@pytest.mark.parametrize("case", sorted(CASES))
def test_api_refuses_hostile_archive(case: str, base: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = hostile(case, base, tmp_path, marker)
    with pytest.raises(LoadError) as info:
        amplite.convert(path)
    message = str(info.value)
    assert CASES[case] in message and "\n" not in message
    if case in PICKLES:
        assert "runs code" in message and "--trust-pickle" in message
    assert not marker.exists()


@pytest.mark.parametrize("case", sorted(CASES))
def test_cli_refuses_hostile_archive(case: str, base: Path, tmp_path: Path, cli) -> None:
    marker = tmp_path / "pwned"
    path = hostile(case, base, tmp_path, marker)
    before = set(tmp_path.iterdir())
    for args in (
        ("convert", path, "-o", tmp_path / "out.pt2"),
        ("inspect", path),
        ("check", path, "--report", tmp_path / "report"),
        ("check", base, "--converted", path, "--report", tmp_path / "report"),
        ("golden", path, "-o", tmp_path / "golden"),
    ):
        res = cli(*args)
        assert res.exit_code == 2, (args, res.stdout, res.stderr)
        assert res.stderr.count("\n") == 1 and CASES[case] in res.stderr, res.stderr
        assert "Traceback" not in res.stdout + res.stderr
    assert set(tmp_path.iterdir()) == before  # nothing written
    assert not marker.exists()


REPORTED = ["sample_inputs", "pickled_weight"]


@pytest.fixture(scope="module")
def fresh_refusals(base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict]]:
    """``amplite convert`` of each reported vector, both calls in ONE fresh interpreter that imported nothing of
    the tests (``tests.test_security_io.run_many``): per case its folder and the call's exit code and output."""
    from tests.test_security_io import run_many

    dirs = {case: tmp_path_factory.mktemp(f"fresh-{case}") for case in REPORTED}
    calls = [["convert", hostile(case, base, d, d / "pwned"), "-o", d / "out.pt2"] for case, d in dirs.items()]
    results = run_many(calls, cwd=tmp_path_factory.mktemp("fresh-cwd"))
    return {case: (dirs[case], res) for case, res in zip(REPORTED, results, strict=True)}


@pytest.mark.parametrize("case", REPORTED)
def test_cli_in_a_fresh_process_refuses_the_two_reported_vectors(case: str, fresh_refusals: dict) -> None:
    folder, res = fresh_refusals[case]
    assert res["rc"] == 2, res["err"]
    assert res["err"].count("\n") == 1 and "runs code" in res["err"] and "--trust-pickle" in res["err"]
    assert "Traceback" not in res["err"] and not (folder / "pwned").exists()
    assert not (folder / "out.pt2").exists() and not list(folder.glob("out*"))


def test_batch_worker_refuses_hostile_archive(base: Path, tmp_path: Path) -> None:
    from amplite.batch import load_jobs

    marker = tmp_path / "pwned"
    src = tmp_path / "zoo"
    src.mkdir()
    hostile("pickled_constant", base, src, marker)
    result = amplite.convert_many(load_jobs(src), tmp_path / "out", workers=1)
    (job,) = result.results
    assert not job.ok and "runs code" in (job.error or ""), job
    assert not marker.exists()


def test_manifest_cannot_opt_in_to_unpickling_alone(base: Path, tmp_path: Path) -> None:
    from amplite.batch import load_jobs

    manifest = tmp_path / "m.toml"
    manifest.write_text(f'[[model]]\npath = "{base}"\ntrust_pickle = true\n')
    with pytest.raises(AmpliteError, match=r"trust_pickle = true.*--trust-pickle"):
        load_jobs(manifest)
    assert load_jobs(manifest, {"trust_pickle": True})[0].options.trust_pickle


def test_trusted_benign_pickle_loads_and_untrusted_is_refused(base: Path, tmp_path: Path, cli) -> None:
    """A weight pickled with a harmless non-tensor attribute needs --trust-pickle, and then it converts."""
    import fractions

    weight = torch.nn.Parameter(torch.randn(3, 4))
    weight.note = fractions.Fraction(1, 2)  # not weights-only: a class global
    path = rebuild(
        base,
        tmp_path / "benign.pt2",
        {W: _set("lin.weight", use_pickle=True), W0: lambda _: saved(weight)},
    )
    res = cli("convert", path, "-o", tmp_path / "out.pt2")
    assert res.exit_code == 2 and "class fractions.Fraction" in res.stderr and "--trust-pickle" in res.stderr
    res = cli("convert", path, "-o", tmp_path / "out.pt2", "--trust-pickle")
    assert res.exit_code == 0, res.stderr
    loaded = torch.export.load(str(tmp_path / "out.pt2"))  # amplite's output is a plain archive again
    x = torch.randn(2, 4) * 3  # not the stored example (the file is exported for batch 2)
    reference = load_program(path, trust_pickle=True).module()(x)
    assert torch.allclose(loaded.module()(x).float(), reference, atol=5e-2)


def test_safe_loader_matches_torch_on_a_benign_archive(base: Path) -> None:
    ours, theirs = load_program(base), torch.export.load(str(base))
    assert str(ours.graph) == str(theirs.graph) and ours.graph_signature == theirs.graph_signature
    assert ours.state_dict.keys() == theirs.state_dict.keys()
    assert all(torch.equal(ours.state_dict[k], theirs.state_dict[k]) for k in ours.state_dict)
    assert isinstance(ours.state_dict["lin.weight"], torch.nn.Parameter)
    x = torch.randn(2, 4)
    assert torch.equal(ours.module()(x), theirs.module()(x))


def test_inputs_file_with_a_pickle_payload_is_refused(base: Path, tmp_path: Path, cli) -> None:
    marker = tmp_path / "pwned"
    inputs = tmp_path / "inputs.pt"
    torch.save((Payload(marker),), inputs)
    res = cli("convert", base, "--inputs", inputs, "-o", tmp_path / "out.pt2")
    assert res.exit_code == 2 and "Traceback" not in res.stderr and not marker.exists()
    assert not (tmp_path / "out.pt2").exists()


@pytest.fixture(scope="module")
def fresh_loads(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict]]:
    """``amplite convert`` in ONE fresh interpreter (``tests.test_security_io.run_many``) of a .pt2 whose outputs
    are a transformers ModelOutput (``"bert"``: transformers is imported on its own, allowlisted), then of one
    whose outputs are a pytree type of the tests, with ``--import`` naming its module (``"pair"``): per case the
    folder and the call's exit code and output."""
    import transformers

    from tests.models.pytree_output import TwoHeads
    from tests.test_security_io import run_many

    bert, pair = tmp_path_factory.mktemp("bert"), tmp_path_factory.mktemp("pair")
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    torch.export.save(torch.export.export(model, (torch.randint(0, 64, (2, 8)),)), str(bert / "bert.pt2"))
    torch.export.save(torch.export.export(TwoHeads().eval(), (torch.randn(3, 8),)), str(pair / "pair.pt2"))
    calls = [["convert", bert / "bert.pt2", "-o", bert / "out.pt2"],  # first: nothing of the tests imported yet
             ["convert", pair / "pair.pt2", "--import", "tests.models.pytree_output", "-o", pair / "out.pt2"]]
    results = run_many(calls, cwd=tmp_path_factory.mktemp("fresh-loads"))
    return {"bert": (bert, results[0]), "pair": (pair, results[1])}


def test_unregistered_output_type_is_named_and_import_fixes_it(fresh_loads: dict, monkeypatch) -> None:
    """Issue 13.3: the error names the pytree class (not custom ops); `--import MODULE` (fresh process) loads it."""
    import torch.utils._pytree as pytree

    folder, res = fresh_loads["pair"]
    name = "tests.models.pytree_output.Pair"
    monkeypatch.delitem(pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE, name)  # as in a process that never imported it
    with pytest.raises(LoadError) as info:
        amplite.convert(folder / "pair.pt2")
    message = str(info.value)
    assert f"pytree type {name}" in message and "custom ops" not in message
    assert "--import tests.models.pytree_output" in message
    monkeypatch.undo()
    assert res["rc"] == 0, res["err"]
    assert (folder / "out.pt2").exists()


def test_archive_cannot_make_amplite_import_a_local_module(base: Path, tmp_path: Path, monkeypatch) -> None:
    """A type name from the file is imported only from the allowlist (installed), never from the working dir."""
    marker = tmp_path / "pwned"
    (tmp_path / "evil_local.py").write_text(f"open({str(marker)!r}, 'w').write('pwned')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))

    def rename_output(doc: dict) -> None:
        sig = doc["graph_module"]["module_call_graph"][0]["signature"]
        sig["out_spec"] = json.dumps([1, {"type": "evil_local.Out", "context": "null", "children_spec": []}])

    path = rebuild(base, tmp_path / "m.pt2", {P: json_edit(rename_output)})
    with pytest.raises(LoadError, match=r"pytree type evil_local\.Out.*--import evil_local"):
        amplite.convert(path)
    assert not marker.exists() and "evil_local" not in sys.modules


def test_transformers_model_output_pt2_converts_in_a_fresh_process(fresh_loads: dict) -> None:
    """A .pt2 of a transformers model returning a ModelOutput: transformers is imported on its own (allowlisted)."""
    folder, res = fresh_loads["bert"]
    assert res["rc"] == 0, res["err"]
    assert (folder / "out.pt2").exists()


class CondModel(torch.nn.Module):
    """Symbolic sizes (srepr expressions), a guard, a torch.cond subgraph and a float input."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        y = torch.cond(x.sum() > 0, lambda a: self.lin(a) * 2, lambda a: self.lin(a) - 1, (x,))
        return y[: x.shape[0] // 2] * scale


def test_safe_loader_accepts_dynamic_shapes_guards_and_subgraphs(tmp_path: Path) -> None:
    """The inspector's rules admit what torch.export.save writes for such a program (no false refusal)."""
    batch = torch.export.Dim("batch", min=2, max=64)
    ep = torch.export.export(CondModel().eval(), (torch.randn(4, 4), 3.0), dynamic_shapes=({0: 2 * batch}, None))
    path = tmp_path / "cond.pt2"
    torch.export.save(ep, str(path))
    ours, theirs = load_program(path), torch.export.load(str(path))
    assert theirs._guards_code and ours._guards_code == []  # the file's guards are never loaded (issue 27.2)
    for x in (torch.randn(6, 4), -torch.rand(10, 4)):
        assert torch.equal(ours.module()(x, 3.0), theirs.module()(x, 3.0))
    with pytest.raises(AssertionError, match="<= 128"):  # guards regenerated from the range constraints
        ours.module()(torch.randn(130, 4), 3.0)


def test_inputs_file_zip_bomb_is_refused(base: Path, tmp_path: Path, cli) -> None:
    bomb = tmp_path / "inputs.npz"
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as z, z.open("x.npy", "w", force_zip64=True) as f:
        _bomb(f)
    res = cli("convert", base, "--inputs", bomb, "-o", tmp_path / "out.pt2")
    assert res.exit_code == 2 and "zip bomb" in res.stderr and "re-save the inputs" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "out.pt2").exists()
