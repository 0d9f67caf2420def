"""JUnit XML and GitHub Actions output for ``amplite check``.

JUnit: one ``<testsuite>`` per model, one ``<testcase>`` per (model, output) with every metric as a
``<property>``; a failed output (or a baseline regression of it) carries a ``<failure>``. With ``--grad``
the gradient check is one more test case. GitHub: ``::error``/``::warning`` workflow commands (the top
error-introducing node is annotated on its source line when that file is inside the workspace) and the
Markdown summary appended to ``$GITHUB_STEP_SUMMARY``.
"""

from __future__ import annotations

import os
import sys
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from amplite import escape
from amplite.report.document import Report, document

_SKIP = {"name", "checks", "notes", "extra", "shape"}


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def junit_xml(report: Report | Mapping[str, Any]) -> str:
    """The JUnit XML document for a check report (a :class:`Report` or ``report.json`` as a dict)."""
    report = document(report)
    check = report.get("check", {})
    model = check.get("name") or "model"
    cfg = report.get("config", {})
    outputs = report.get("verification", {}).get("outputs", [])
    regressions: dict[str, list[dict[str, Any]]] = {}
    for r in report.get("baseline", {}).get("regressions", []):
        regressions.setdefault(r["output"], []).append(r)
    seconds = float(report.get("timings", {}).get("verify", 0.0))
    root = ET.Element("testsuites", name="amplite check")
    suite = ET.SubElement(root, "testsuite", name=f"amplite.check.{model}", timestamp=report.get("created", ""))
    props = ET.SubElement(suite, "properties")
    for key in ("precision", "level", "converted"):
        if key in cfg:
            ET.SubElement(props, "property", name=key, value=str(cfg[key]))
    ET.SubElement(props, "property", name="inputs", value=str(report.get("verification", {}).get("inputs", "")))
    cases = failures = 0
    for o in outputs:
        case = ET.SubElement(
            suite,
            "testcase",
            classname=f"amplite.{model}",
            name=o["name"],
            time=f"{seconds / max(1, len(outputs)):.4f}",
        )
        cprops = ET.SubElement(case, "properties")
        for key, value in o.items():
            if key not in _SKIP and value is not None:
                ET.SubElement(cprops, "property", name=key, value=_fmt(value))
        for c in o.get("checks", []):
            ET.SubElement(cprops, "property", name=f"check:{c['criterion']}", value=_fmt(c["value"]))
        problems = [c["criterion"] + f" (got {_fmt(c['value'])})" for c in o.get("checks", []) if not c["passed"]]
        problems += [
            f"{r['metric']} regressed from {r['baseline']} to {r['current']} (baseline)"
            for r in regressions.get(o["name"], [])
        ]
        if problems or not o.get("passed", True):
            failures += 1
            fail = ET.SubElement(
                case, "failure", message="; ".join(problems or o.get("notes", [])) or "failed", type="AccuracyFailure"
            )
            fail.text = "\n".join(problems + o.get("notes", []) + _top_lines(report))
        cases += 1
    grads = report.get("gradients")
    if grads:
        case = ET.SubElement(
            suite, "testcase", classname=f"amplite.{model}", name="gradients", time=_fmt(grads.get("seconds", 0.0))
        )
        gprops = ET.SubElement(case, "properties")
        for key in ("loss", "parameters", "min_sqnr_db", "median_sqnr_db"):
            ET.SubElement(gprops, "property", name=key, value=_fmt(grads.get(key)))
        for key, value in grads.get("underflow", {}).items():
            ET.SubElement(gprops, "property", name=f"underflow:{key}", value=_fmt(value))
        if not grads.get("passed", True):
            failures += 1
            ET.SubElement(
                case,
                "failure",
                type="GradientFailure",
                message="NaN/Inf gradients in " + ", ".join(grads["nonfinite_parameters"][:5]),
            )
        cases += 1
    train = report.get("training")
    if train:  # check --train-steps: one test case for the loss-curve gate
        case = ET.SubElement(suite, "testcase", classname=f"amplite.{model}", name="training",
                             time=_fmt(train.get("seconds", {}).get("train", 0.0)))  # fmt: skip
        tprops = ET.SubElement(case, "properties")
        for key in ("steps", "precision", "level", "max_gap"):
            ET.SubElement(tprops, "property", name=key, value=_fmt(train.get(key)))
        ET.SubElement(tprops, "property", name="train_loss_gap<=", value=_fmt(train["tolerance"]["train_loss_gap"]))
        ET.SubElement(tprops, "property", name="skipped_steps", value=str(len(train.get("skipped_steps", []))))
        if not train.get("passed", True):
            failures += 1
            message = "; ".join(check.get("reasons", [])) or "training loss gap beyond the limit"
            ET.SubElement(case, "failure", type="TrainingFailure", message=message)
        cases += 1
    for el in (root, suite):
        el.set("tests", str(cases))
        el.set("failures", str(failures))
        el.set("errors", "0")
    suite.set("skipped", "0")
    suite.set("time", f"{seconds:.4f}")
    for el in root.iter():  # names and messages come from the model: keep the file valid XML
        el.attrib.update({k: escape.xml(v) for k, v in el.attrib.items()})
        if el.text:
            el.text = escape.xml(el.text)
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def _top_lines(report: dict[str, Any], n: int = 3) -> list[str]:
    lines = []
    for e in report.get("layerwise", {}).get("top_introducers", [])[:n]:
        what = (
            "introduces NaN/Inf" if e["introduces_nonfinite"] else f"isolated SQNR {_fmt(e['isolated']['sqnr_db'])} dB"
        )
        lines.append(f"node {e['node']} ({e['op']}, module {e['module'] or '(root)'}, {e['source']}): {what}")
    return lines


def _escape(text: str) -> str:
    """Workflow-command escaping (``%``, CR, LF; plus ``:`` and ``,`` in properties); other control
    characters (ESC...) are shown as text (:func:`amplite.escape.terminal`): the log is a terminal."""
    return escape.terminal(text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A"))


def _prop(text: str) -> str:
    return _escape(text).replace(":", "%3A").replace(",", "%2C")


def github_annotations(report: Report | Mapping[str, Any], workspace: str | None = None) -> list[str]:
    """``::error``/``::warning``/``::notice`` lines for a check report."""
    report = document(report)
    check = report.get("check", {})
    model = check.get("name") or "model"
    lines = [f"::error title={_prop(f'amplite check {model}')}::{_escape(r)}" for r in check.get("reasons", [])]
    top = report.get("layerwise", {}).get("top_introducers", [])
    if top and not check.get("passed", True):
        e = top[0]
        where = ""
        file, _, line = (e.get("source") or "").rpartition(":")
        root = Path(workspace or os.environ.get("GITHUB_WORKSPACE", "") or ".").resolve()
        if file and line.isdigit() and Path(file).resolve().is_relative_to(root):
            where = f"file={_prop(str(Path(file).resolve().relative_to(root)))},line={line},"
        msg = _top_lines(report, 1)[0]
        lines.append(f"::warning {where}title={_prop('amplite: top error-introducing node')}::{_escape(msg)}")
    if check.get("passed"):
        lines.append(f"::notice title={_prop(f'amplite check {model}')}::all outputs within tolerance")
    return lines


def publish_github(
    report: Report | Mapping[str, Any], markdown: str | None = None, stream: TextIO | None = None
) -> bool:
    """Under GitHub Actions (``GITHUB_ACTIONS=true``): print the annotations and append ``markdown`` to the
    step summary. Returns whether it did anything."""
    if os.environ.get("GITHUB_ACTIONS") != "true":
        return False
    out = stream or sys.stdout
    for line in github_annotations(report):
        print(line, file=out)
    summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if summary and markdown:
        with open(summary, "a", encoding="utf-8") as f:
            f.write(markdown + "\n")
    return True
