"""The CI gate: ``amplite check`` and ``amplite golden``.

``run`` holds :func:`check` as a short sequence of named steps (guard the files; pick the path:
checkpoint directory, training, or outputs; build the FP32/converted pair; verify every batch; localise;
judge; write). ``steps`` holds those steps; ``outputs`` what every kind of check reads and writes, and its
verdict; ``settings`` the gate's own settings (``CheckSettings``).
Layer: above ``save``/``training``/``api`` (docs/architecture.md).
"""

from amplite.gate.outputs import CheckResult, publish_github_summary, write_reports
from amplite.gate.run import check, make_golden
from amplite.gate.settings import CheckSettings

__all__ = ["CheckResult", "CheckSettings", "check", "make_golden", "publish_github_summary", "write_reports"]
