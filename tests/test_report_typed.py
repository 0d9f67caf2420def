"""Every report section is typed and frozen (issue 46, item 4): each round-trips through its type without
loss, every schema key has a section type (and every type a schema key), a planted invalid section is refused
on write with no flag set, and the renderers read the typed sections: the budget and gradient lines are worded
once and read the same in report.md, report.html and the terminal."""

from __future__ import annotations

import dataclasses
import html
import json
import re
from pathlib import Path
from typing import Any

import pytest

import amplite
from amplite.errors import InternalError
from amplite.gate import write_reports
from amplite.report.analysis import Gradients, Llm, Training
from amplite.report.checks import Baseline, Budget, Check, Verification
from amplite.report.document import HEADER_KEYS, Report
from amplite.report.entries import CriterionCheck, OutputMetricsEntry
from amplite.report.junit import junit_xml
from amplite.report.schema import load_schema, validate_report
from amplite.report.sections import SECTIONS, Output, Outputs, Plan, Source, Streaming, Timings, WeightRules
from amplite.report.typed import Entry, ListSection, MapSection, Num, Record
from fixtures import zoo
from tests.report_samples import SAMPLES


@pytest.fixture(scope="module")
def module_report() -> Report:
    model, inputs = zoo.make("mlp")
    return amplite.convert(model, inputs, level="O1").report


@pytest.fixture(scope="module")
def samples(module_report: Report) -> dict[str, Any]:
    """A JSON value for every section: the MLP conversion's own, and the hand-written ones for the rest."""
    return {**module_report.to_dict(), **SAMPLES}


def _resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        node = schema["$defs"][node["$ref"].rsplit("/", 1)[1]]
    return node


def test_every_schema_key_has_a_section_type_and_every_type_a_schema_key() -> None:
    keys = set(load_schema()["properties"]) - set(HEADER_KEYS)
    assert set(SECTIONS) == keys, f"no type: {sorted(keys - set(SECTIONS))}; no schema: {sorted(set(SECTIONS) - keys)}"
    assert all(cls.key == key and issubclass(cls, Record) for key, cls in SECTIONS.items())


def test_every_schema_property_of_a_section_is_a_typed_field() -> None:
    schema = load_schema()
    for key, cls in SECTIONS.items():
        node = _resolve(schema, schema["properties"][key])
        if issubclass(cls, ListSection):  # the entries' keys are the entry type's fields
            item, node = cls.item, _resolve(schema, node.get("items", {}))
            declared = {f.name for f in dataclasses.fields(item)} if item else set()
        elif issubclass(cls, MapSection):
            continue  # timings: a map of phases, no fixed keys
        else:
            declared = {f.name for f in dataclasses.fields(cls)}
        missing = set(node.get("properties", {})) - declared
        assert not missing, f"{cls.__name__} does not type {sorted(missing)}"


def test_the_samples_cover_every_section_and_validate(samples: dict[str, Any]) -> None:
    assert set(SECTIONS) <= set(samples)
    validate_report(samples)  # the samples are what amplite writes, not shapes made up for the round trip


@pytest.mark.parametrize("key", sorted(SECTIONS))
def test_each_section_round_trips_without_loss(key: str, samples: dict[str, Any]) -> None:
    value = samples[key]
    section = SECTIONS[key].from_json(value)
    # the same keys, in the same order, with the same values (null and "inf"/"nan" included)
    assert json.dumps(section.to_json()) == json.dumps(value)
    again = SECTIONS[key].from_json(section.to_json())
    assert again == section and again.value == value
    if not isinstance(section, (ListSection, MapSection)):
        assert not section.rest, f"keys the {type(section).__name__} type does not declare: {sorted(section.rest)}"


def test_sections_are_typed_and_frozen(module_report: Report) -> None:
    ver = module_report.section(Verification)
    out = ver.outputs[0]
    assert isinstance(out, OutputMetricsEntry) and isinstance(out.checks[0], CriterionCheck)
    assert out.sqnr_db == module_report.data["verification"]["outputs"][0]["sqnr_db"] and out.passed is True
    assert ver.tolerance.min_sqnr_db == module_report.data["verification"]["tolerance"]["min_sqnr_db"]
    plan = module_report.section(Plan)
    assert [p.node for p in plan] == [p["node"] for p in module_report.data["plan"]]
    with pytest.raises(dataclasses.FrozenInstanceError):
        ver.passed = False  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.sqnr_db = 0.0  # type: ignore[misc]
    with pytest.raises(TypeError, match="read-only"):
        out.shape.append(1)  # type: ignore[union-attr]
    with pytest.raises(TypeError, match="read-only"):
        module_report.section(Timings).values["save_pt2"] = 1.0  # type: ignore[index]
    budget = Budget.from_json(SAMPLES["budget"])
    assert budget.steps[1].worst_sqnr_db == "nan" and budget.prune.before == 1 and budget.tolerance.criteria == [
        "sqnr_db>=40"]


def test_typed_accessors_read_what_the_document_holds(module_report: Report) -> None:
    data = module_report.data
    counted = next(p for p in data["passes"] if any(p["counters"].values()))
    key, value = next((k, v) for k, v in counted["counters"].items() if v)
    assert module_report.counter(counted["name"], key) == value > 0
    assert module_report.counter(counted["name"], "no such counter") == 0 and module_report.counter("nope", key) == 0
    changed = {p["name"] for p in data["passes"] if p["modified"]}
    unchanged = {p["name"] for p in data["passes"] if not p["modified"]}
    assert changed and all(module_report.pass_modified(n) for n in changed)
    assert not any(module_report.pass_modified(n) for n in unchanged | {"no such pass"})
    assert [(p.node, p.mode, p.dtype) for p in module_report.planned] == [
        (p["node"], p["mode"], p["dtype"]) for p in data["plan"]]
    assert module_report.passed is data["verification"]["passed"] is True
    assert [o.name for o in module_report.verified_outputs] == [o["name"] for o in data["verification"]["outputs"]]
    assert Report({k: v for k, v in data.items() if k != "verification"}).verified_outputs == ()


def test_the_builders_make_the_documented_values(module_report: Report) -> None:
    assert Source.of("m.pt2", "pt2", mode=None, graph_fingerprint="ab").to_json() == {
        "path": "m.pt2", "format": "pt2", "graph_fingerprint": "ab"}  # None facts are left out
    assert Source.of(None, "module").to_json() == {"path": None, "format": "module"}
    assert Check.of("m", []).to_json() == {"name": "m", "passed": True, "exit_code": 0, "reasons": []}
    assert Check.of("m", ["x"]).to_json() == {"name": "m", "passed": False, "exit_code": 1, "reasons": ["x"]}
    regression = SAMPLES["baseline"]["regressions"][0]
    assert Baseline.of(1.0, [], None).to_json() == {"margin_db": 1.0, "regressions": [], "passed": True,
                                                    "created": None}  # fmt: skip
    assert Baseline.of(2.0, [regression], "t").passed is False
    ver = module_report.section(Verification)
    assert ver.folded(False).passed is False and ver.folded(True).passed is True
    assert Verification.from_json({"outputs": []}).folded(True).passed is True
    assert Verification.from_json({"passed": False}).folded(True).passed is False
    one, two = {"format": "pt2", "path": "/a.pt2", "bytes": 1}, {"format": "onnx", "path": "/b.onnx", "bytes": 2}
    assert Outputs.of([one, two]).with_entries({**one, "bytes": 3}).to_json() == [two, {**one, "bytes": 3}]
    assert Streaming.of(1, 2, 3).to_json() == {"peak_rss_bytes": 1, "largest_shard_bytes": 2, "shards": 3}
    assert WeightRules.of({"lm_head": "range:weight-overflow"}).to_json() == [
        {"module": "lm_head", "reason": "range:weight-overflow"}]
    assert Timings.of({"a": 0.123456}).add(b=1.00004, a=2).to_json() == {"a": 2.0, "b": 1.0}
    llm = Llm.from_json(SAMPLES["llm"]).add(peak_rss_bytes=5, passed=True)
    assert llm.peak_rss_bytes == 5 and llm.passed is True and llm.to_json() == {**SAMPLES["llm"], "passed": True,
                                                                                 "peak_rss_bytes": 5}  # fmt: skip


def test_the_conversion_builders_write_the_documented_json() -> None:
    from amplite.passes.base import PassRecord
    from amplite.report.entries import GraphStats
    from amplite.report.sections import Fp32Nodes, Graph, Passes, Warnings, Weights
    from amplite.verify.compare import OutputMetrics, Tolerance

    records = [PassRecord("a", True, {"n": 2}, 0.123456, {"why": "x"}), PassRecord("b", False, {}, 1.0)]
    assert Passes.of(records).to_json() == [
        {"name": "a", "modified": True, "counters": {"n": 2}, "seconds": 0.1235, "details": {"why": "x"}},
        {"name": "b", "modified": False, "counters": {}, "seconds": 1.0}]  # no details: no key
    assert Weights.of(300, 100).to_json() == {"bytes_before": 300, "bytes_after": 100, "ratio": 0.3333}
    assert Weights.of(0, 0).ratio == 1.0 and type(Weights.of(3.0, 1.0).bytes_after) is int  # type: ignore[arg-type]
    plan = [{"node": "a", "op": "add", "module": "m", "source": "s:1", "mode": "fp32", "dtype": None,
             "reason": "r", "rule": "range"},
            {"node": "b", "op": "mm", "module": "m", "source": "s:2", "mode": "low", "dtype": "float16",
             "reason": "r", "rule": "op-table"},
            {"node": "c", "op": "exp", "module": "m", "source": "s:3", "mode": "fp32", "dtype": None, "reason": "q"}]
    assert Fp32Nodes.of(plan).to_json() == [
        {"node": "a", "op": "add", "module": "m", "source": "s:1", "reason": "r", "rule": "range"},
        {"node": "c", "op": "exp", "module": "m", "source": "s:3", "reason": "q"}]
    stats = {"nodes_by_dtype": {"float32": 3}, "casts": 0, "low_precision_flop_share": 0.0}
    assert Graph.of(GraphStats.from_json(stats), {**stats, "casts": 2}).to_json() == {
        "before": stats, "after": {**stats, "casts": 2}}
    assert Source.of(Path("/m.pt2"), "pt2").path == "/m.pt2"
    assert Warnings.of([1, "w"]).to_json() == ["1", "w"]
    assert Timings.of({"a": 0.123456, "b": 2}).to_json() == {"a": 0.1235, "b": 2.0}
    tol = Tolerance(min_sqnr_db=40.0, min_cosine=0.99, criteria=("sqnr_db>=40",))
    good = OutputMetrics("out", [2], "float16", sqnr_db=50.0)
    bad = OutputMetrics("bad", [2], "float16", sqnr_db=10.0, passed=False)
    ver = Verification.of([good], tol)
    assert ver.to_json() == {"inputs": "example inputs", "tolerance": {"min_sqnr_db": 40.0, "min_cosine": 0.99,
                             "max_mismatch": 0.01, "criteria": ["sqnr_db>=40"]}, "passed": True,
                             "outputs": [good.to_dict()]}  # fmt: skip
    other = Verification.of([good, bad], None, inputs="3 random batches", batches=3).to_json()
    assert other["tolerance"] is None and other["passed"] is False and other["batches"] == 3
    assert other["inputs"] == "3 random batches" and [o["name"] for o in other["outputs"]] == ["out", "bad"]


def test_the_budget_and_gradient_sentences() -> None:
    from amplite.report.format import Style

    marked = Style(text=lambda s: f"<{s}>", code=lambda s: f"`{s}`", strong=lambda s: f"*{s}*")
    budget = Budget.from_json(SAMPLES["budget"])
    assert budget.summary(marked) == (
        "*Accuracy budget* (`sqnr_db>=40`): *NOT met* with 1 of 7 candidate nodes moved to FP32 (`pow_1`), "
        "3 trials (bound 16), <1.25> s. <even with all 7 candidate nodes in FP32 the tolerance is not met>")
    moved = [{**SAMPLES["budget"]["moved_to_fp32"][0], "node": f"n{i}"} for i in range(3)]
    met = Budget.from_json({**SAMPLES["budget"], "passed": True, "moved_to_fp32": moved, "message": "",
                            "prune": {"before": 5, "after": 3, "trials": 4, "bound": 5},
                            "tolerance": {**SAMPLES["budget"]["tolerance"], "criteria": []}})  # fmt: skip
    assert met.summary(names=2) == ("Accuracy budget (sqnr_db>=40.0): met with 3 of 7 candidate nodes moved to "
                                    "FP32 (n0, n1, …), 3 trials (bound 16), 1.25 s. The prune phase took 5 nodes "
                                    "down to 3.")  # fmt: skip
    grads = Gradients.from_json(SAMPLES["gradients"])
    assert grads.summary(marked) == (
        "*Gradients* (<sum of outputs>, <as converted>): 4 parameters compared, *1 missing*; min SQNR <31.5> dB, "
        "median <–> dB; <12.5> % underflow in <float16> unscaled; recommended: <loss scale 1024>.")
    advised = Gradients.from_json({**SAMPLES["gradients"], "missing_gradients": [], "graph": None,
                                   "underflow": {"dtype": "bfloat16", "values": 1, "advice": "none needed"}})
    bare = Budget.from_json({**SAMPLES["budget"], "tolerance": None, "moved_to_fp32": [], "seconds": 1.23456,
                             "message": ""})  # fmt: skip
    assert bare.summary(marked) == ("*Accuracy budget* (`sqnr_db>=None`): *NOT met* with 0 of 7 candidate nodes "
                                    "moved to FP32, 3 trials (bound 16), <1.23> s.")  # fmt: skip
    assert met.summary(names=3).endswith("(n0, n1, n2), 3 trials (bound 16), 1.25 s. The prune phase took 5 nodes "
                                         "down to 3.")  # fmt: skip
    fine = Gradients.from_json({**SAMPLES["gradients"], "median_sqnr_db": 45.678, "missing_gradients": [],
                                "underflow": {"dtype": "float16", "values": 1, "underflow_unscaled": 0.123456}})
    assert ("0 missing; min SQNR <31.5> dB, median <45.68> dB; <12.3> % underflow" in fine.summary(marked))
    assert advised.summary() == ("Gradients (sum of outputs, as converted): 4 parameters compared, 0 missing; "
                                 "min SQNR 31.5 dB, median – dB; 0 % underflow in bfloat16 unscaled; "
                                 "recommended: none needed.")


def test_a_planted_invalid_section_is_refused_on_write(module_report: Report, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.delenv("AMPLITE_VALIDATE_REPORTS", raising=False)  # no flag: a user's run validates too
    report = module_report.with_sections(Budget.from_json({**SAMPLES["budget"], "trials": "many"}))
    assert report.section(Budget).trials == "many"  # read as written, never coerced: the writer names it
    with pytest.raises(InternalError, match=r"at budget\.trials: 'many' is not of type 'integer'"):
        report.save(tmp_path / "r.json")
    with pytest.raises(InternalError, match=r"budget\.trials"):
        write_reports(report, tmp_path / "gate")
    assert not (tmp_path / "r.json").exists() and not (tmp_path / "gate" / "report.json").exists()
    entry = {**SAMPLES["check"], "exit_code": 7}
    with pytest.raises(InternalError, match=r"check\.exit_code"):
        module_report.with_sections(Check.from_json(entry)).save(tmp_path / "c.json")


def test_an_older_or_newer_report_reads_and_writes_back_the_same(module_report: Report, tmp_path: Path) -> None:
    doc = module_report.to_dict()
    doc["verification"]["outputs"][0]["future_metric"] = 1.5  # a key a later amplite adds inside a section
    doc["output"] = SAMPLES["output"]  # the section older reports wrote instead of ``outputs``
    path = tmp_path / "old.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    back = Report(json.loads(path.read_text()))
    assert back.section(Output).path == "/tmp/m.pt2"
    assert back.section(Verification).outputs[0].rest == {"future_metric": 1.5}
    assert back.save(tmp_path / "again.json").read_text() == path.read_text()


def _plain(text: str) -> str:
    """Rendered text without its markup (Markdown marks, HTML tags and entities), whitespace collapsed."""
    text = html.unescape(re.sub(r"<[^>]+>", "", text)).replace("**", "").replace("`", "").replace("\\", "")
    return " ".join(text.split())


def test_renderers_read_the_typed_sections_and_word_budget_and_gradients_once(module_report: Report,
                                                                              tmp_path: Path) -> None:  # fmt: skip
    name = module_report.verified_outputs[0].name  # the baseline's regression is of this model's output
    regression = {**SAMPLES["baseline"]["regressions"][0], "output": name}
    report = module_report.with_sections(*(s.from_json(SAMPLES[s.key]) for s in (Budget, Gradients, Training, Check)),
                                         Baseline.from_json({**SAMPLES["baseline"], "regressions": [regression]}))
    files = write_reports(report, tmp_path)
    md, page = files["md"].read_text(), files["html"].read_text()
    budget_line = report.section(Budget).summary()
    grads_line = report.section(Gradients).summary()
    assert budget_line.startswith("Accuracy budget (sqnr_db>=40): NOT met with 1 of 7 candidate nodes moved to FP32 "
                                  "(pow_1), 3 trials (bound 16), 1.25 s. even with all 7")
    assert grads_line.startswith("Gradients (sum of outputs, as converted): 4 parameters compared, 1 missing; "
                                 "min SQNR 31.5 dB, median – dB; 12.5 % underflow in float16 unscaled; "
                                 "recommended: loss scale 1024")
    for rendered in (md, page):  # one wording: the same sentence in report.md and report.html
        assert budget_line in _plain(rendered) and grads_line in _plain(rendered)
    assert "**NOT met**" in md and "<strong>NOT met</strong>" in page
    assert "| 1 | 1 | 1 | 0 |" in md  # the training section's logged step, read from its typed entries
    assert "**Baseline** (margin 1 dB): 1 regression(s)." in md
    xml = junit_xml(json.loads(files["json"].read_text()))  # a report.json read back renders the same
    assert xml == junit_xml(report)
    assert 'name="gradients"' in xml and 'name="training"' in xml
    assert "sqnr_db regressed from 50.0 to 41.5 (baseline)" in xml


def test_the_terminal_summary_prints_the_same_budget_line(module_report: Report, tmp_path: Path) -> None:
    from amplite.cli import output

    report = module_report.with_sections(Budget.from_json(SAMPLES["budget"]))
    with output.out.capture() as captured:
        output.print_summary(report, [], tmp_path / "r.json")
    said = " ".join(captured.get().split())
    assert report.section(Budget).summary() in said
    assert f"FP32 islands │ {len(module_report.data['fp32_nodes'])}" in said


# --- Fast direct tests (issue 46: the mutation run's survivors in Budget.moved_where and the typed readers)


def test_budget_says_where_the_search_moved_nodes() -> None:
    from amplite.report.checks import MovedNode

    def where(*to: str | None) -> str:
        return Budget(moved_to_fp32=tuple(MovedNode(node=f"n{i}", to=t) for i, t in enumerate(to))).moved_where()

    assert where() == "to FP32" and Budget().moved_where() == "to FP32"
    assert where(None) == where("float32") == where(None, "float32") == "to FP32"  # no "to": FP32
    assert where("bfloat16") == where("bfloat16", "bfloat16") == "from FP8 to bf16"
    assert where("bfloat16", None) == where("float32", "bfloat16") == "to bf16 (FP8) / FP32"


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Leaf(Entry):
    name: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Tree(Entry):
    one: _Leaf | None = None
    many: tuple[_Leaf, ...] | None = None
    ints: tuple[int, ...] | None = None
    plain: list[Any] | None = None
    num: Num | None = None
    mixed: int | _Leaf | None = None  # the record type is not the union's first member


def test_fields_typed_as_records_read_into_records_and_plain_json_stays_plain() -> None:
    doc = {"one": {"name": "a"}, "many": [{"name": "b"}, 7], "ints": [1, 2], "plain": [{"name": "c"}],
           "num": "inf", "extra": {"x": 1}}  # fmt: skip
    tree = _Tree.from_json(doc)
    assert tree.one == _Leaf(name="a") and isinstance(tree.one, _Leaf)
    assert isinstance(tree.many, tuple) and tree.many[0] == _Leaf(name="b") and tree.many[1] == 7
    assert tree.ints == [1, 2] and not isinstance(tree.ints, tuple)  # a tuple of plain values: plain JSON
    assert tree.plain == [{"name": "c"}] and not isinstance(tree.plain[0], Entry)
    with pytest.raises(TypeError):
        tree.plain.append(1)  # plain JSON is read-only
    assert tree.num == "inf" and dict(tree.rest) == {"extra": {"x": 1}}
    assert tree.to_json() == doc and list(tree.to_json()) == list(doc)
    wrong = _Tree.from_json({"one": [1], "many": {"name": "d"}})  # wrong JSON types: kept for the schema check
    assert wrong.one == [1] and wrong.many == {"name": "d"}
    assert _Tree(one=_Leaf(name="e"), many=(_Leaf(name="f"),)).to_json() == {"one": {"name": "e"},
                                                                           "many": [{"name": "f"}]}  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Leaves(ListSection):
    key = "leaves"
    item = _Leaf


def test_reading_keeps_what_it_cannot_type_and_writes_fields_set_after_reading() -> None:
    assert _Tree.from_json({"mixed": {"name": "m"}}).mixed == _Leaf(name="m")
    with pytest.raises(TypeError, match="_Tree reads a JSON object, not list"):
        _Tree.from_json([1])
    with pytest.raises(TypeError):
        _Tree(rest={"a": [1]}).rest["a"].append(2)  # rest given in code is frozen too
    read = _Tree.from_json({"num": 1.5})
    assert dataclasses.replace(read, one=_Leaf(name="z")).to_json() == {"num": 1.5, "one": {"name": "z"}}
    assert list(_Leaves.from_json([{"name": "a"}, 7]).items) == [_Leaf(name="a"), 7]  # a non-object entry kept
    assert _Leaves.from_json("abc").items == "abc" and _Leaves.from_json({"a": 1}).items == {"a": 1}
    assert _Leaves.from_json(5).items == 5  # not a list: kept for the schema check to name


def test_the_budget_sentence_names_at_most_five_moved_nodes_by_default() -> None:
    from amplite.report.checks import MovedNode

    budget = Budget(moved_to_fp32=tuple(MovedNode(node=f"node{i}") for i in range(6)), candidates=9)
    text = budget.summary()
    assert "node4, …" in text and "node5" not in text and "6 of 9 candidate nodes" in text
    assert "node5" in budget.summary(names=6)
