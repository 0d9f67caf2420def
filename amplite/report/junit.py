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
from amplite.report.analysis import Gradients, Layerwise, Training
from amplite.report.checks import Baseline, Check, Regression, Verification
from amplite.report.document import Report, as_report
from amplite.report.entries import OutputMetricsEntry
from amplite.report.sections import Config, Timings

_SKIP = {"name", "checks", "notes", "extra", "shape"}


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def _output_case(suite: ET.Element, model: str, o: OutputMetricsEntry, seconds: float,
                 regressions: list[Regression], top: list[str]) -> bool:
    """One output's test case (every metric a property); whether it failed."""
    case = ET.SubElement(suite, "testcase", classname=f"amplite.{model}", name=str(o.name), time=f"{seconds:.4f}")
    cprops = ET.SubElement(case, "properties")
    for key, value in o.to_json().items():  # every metric the output has, declared or not
        if key not in _SKIP and value is not None:
            ET.SubElement(cprops, "property", name=key, value=_fmt(value))
    for c in o.checks or ():
        ET.SubElement(cprops, "property", name=f"check:{c.criterion}", value=_fmt(c.value))
    problems = [f"{c.criterion} (got {_fmt(c.value)})" for c in o.checks or () if not c.passed]
    problems += [f"{r.metric} regressed from {r.baseline} to {r.current} (baseline)" for r in regressions]
    notes = list(o.notes or [])
    if not problems and o.passed is not False:
        return False
    fail = ET.SubElement(case, "failure", message="; ".join(problems or notes) or "failed", type="AccuracyFailure")
    fail.text = "\n".join(problems + notes + top)
    return True


def _gradients_case(suite: ET.Element, model: str, grads: Gradients) -> bool:
    """The gradient check's test case; whether it failed."""
    case = ET.SubElement(suite, "testcase", classname=f"amplite.{model}", name="gradients",
                         time=_fmt(grads.seconds if grads.seconds is not None else 0.0))  # fmt: skip
    gprops = ET.SubElement(case, "properties")
    for key in ("loss", "parameters", "min_sqnr_db", "median_sqnr_db"):
        ET.SubElement(gprops, "property", name=key, value=_fmt(getattr(grads, key)))
    for key, value in (grads.underflow.to_json() if grads.underflow is not None else {}).items():
        ET.SubElement(gprops, "property", name=f"underflow:{key}", value=_fmt(value))
    if grads.passed is not False:
        return False
    ET.SubElement(case, "failure", type="GradientFailure",
                  message="NaN/Inf gradients in " + ", ".join((grads.nonfinite_parameters or [])[:5]))  # fmt: skip
    return True


def _training_case(suite: ET.Element, model: str, train: Training, reasons: list[str]) -> bool:
    """check --train-steps: one test case for the loss-curve gate; whether it failed."""
    case = ET.SubElement(suite, "testcase", classname=f"amplite.{model}", name="training",
                         time=_fmt((train.seconds or {}).get("train", 0.0)))  # fmt: skip
    tprops = ET.SubElement(case, "properties")
    for key in ("steps", "precision", "level", "max_gap"):
        ET.SubElement(tprops, "property", name=key, value=_fmt(getattr(train, key)))
    ET.SubElement(tprops, "property", name="train_loss_gap<=", value=_fmt(train.gap_limit))
    ET.SubElement(tprops, "property", name="skipped_steps", value=str(len(train.skipped_steps or [])))
    if train.passed is not False:
        return False
    message = "; ".join(reasons) or "training loss gap beyond the limit"
    ET.SubElement(case, "failure", type="TrainingFailure", message=message)
    return True


def junit_xml(report: Report | Mapping[str, Any]) -> str:
    """The JUnit XML document for a check report (a :class:`Report` or ``report.json`` as a dict)."""
    rep = as_report(report)
    check, cfg = rep.section(Check) or Check(), rep.section(Config) or Config()
    ver = rep.section(Verification) or Verification()
    model = check.name or "model"
    outputs = ver.outputs or ()
    regressions: dict[str, list[Regression]] = {}
    for r in (rep.section(Baseline) or Baseline()).regressions or ():
        regressions.setdefault(str(r.output), []).append(r)
    seconds = float((rep.section(Timings) or Timings()).values.get("verify", 0.0))
    root = ET.Element("testsuites", name="amplite check")
    suite = ET.SubElement(root, "testsuite", name=f"amplite.check.{model}", timestamp=rep.data.get("created", ""))
    props = ET.SubElement(suite, "properties")
    for key in ("precision", "level", "converted"):
        if getattr(cfg, key) is not None:
            ET.SubElement(props, "property", name=key, value=str(getattr(cfg, key)))
    ET.SubElement(props, "property", name="inputs", value=str(ver.inputs or ""))
    top = _top_lines(rep)
    failed = [_output_case(suite, model, o, seconds / max(1, len(outputs)), regressions.get(str(o.name), []), top)
              for o in outputs]  # fmt: skip
    if (grads := rep.section(Gradients)) is not None:
        failed.append(_gradients_case(suite, model, grads))
    if (train := rep.section(Training)) is not None:
        failed.append(_training_case(suite, model, train, list(check.reasons or [])))
    for el in (root, suite):
        el.set("tests", str(len(failed)))
        el.set("failures", str(sum(failed)))
        el.set("errors", "0")
    suite.set("skipped", "0")
    suite.set("time", f"{seconds:.4f}")
    for el in root.iter():  # names and messages come from the model: keep the file valid XML
        el.attrib.update({k: escape.xml(v) for k, v in el.attrib.items()})
        if el.text:
            el.text = escape.xml(el.text)
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def _top_lines(rep: Report, n: int = 3) -> list[str]:
    lw = rep.section(Layerwise)
    lines = []
    for e in list((lw.top_introducers or ()) if lw is not None else ())[:n]:
        iso = e.isolated.sqnr_db if e.isolated is not None else None
        what = "introduces NaN/Inf" if e.introduces_nonfinite else f"isolated SQNR {_fmt(iso)} dB"
        lines.append(f"node {e.node} ({e.op}, module {e.module or '(root)'}, {e.source}): {what}")
    return lines


def _escape(text: str) -> str:
    """Workflow-command escaping (``%``, CR, LF; plus ``:`` and ``,`` in properties); other control
    characters (ESC...) are shown as text (:func:`amplite.escape.terminal`): the log is a terminal."""
    return escape.terminal(text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A"))


def _prop(text: str) -> str:
    return _escape(text).replace(":", "%3A").replace(",", "%2C")


def github_annotations(report: Report | Mapping[str, Any], workspace: str | None = None) -> list[str]:
    """``::error``/``::warning``/``::notice`` lines for a check report."""
    rep = as_report(report)
    check = rep.section(Check) or Check()
    model = check.name or "model"
    lines = [f"::error title={_prop(f'amplite check {model}')}::{_escape(r)}" for r in check.reasons or []]
    lw = rep.section(Layerwise)
    top = (lw.top_introducers or ()) if lw is not None else ()
    if top and check.passed is False:
        e = top[0]
        where = ""
        file, _, line = (e.source or "").rpartition(":")
        root = Path(workspace or os.environ.get("GITHUB_WORKSPACE", "") or ".").resolve()
        if file and line.isdigit() and Path(file).resolve().is_relative_to(root):
            where = f"file={_prop(str(Path(file).resolve().relative_to(root)))},line={line},"
        msg = _top_lines(rep, 1)[0]
        lines.append(f"::warning {where}title={_prop('amplite: top error-introducing node')}::{_escape(msg)}")
    if check.passed:
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
