"""Predicted GPU time before you have a GPU: a per-node roofline over an exported program.

``profiles`` holds the device table (data, with sources), ``cost`` the per-node FLOP/byte/time model,
``autocast`` the same model applied to torch.autocast's execution of the FP32 graph, ``summary`` the
report section. Everything here is an estimate and says so. Layer: imports ``converter`` (graph facts),
``passes.graph_utils``, ``op_tables`` and ``errors``; never ``verify``, ``report``, the API or the CLI.
"""

from amplite.estimate.profiles import DEFAULT_PROFILE, PROFILES, GpuProfile, get_profile
from amplite.estimate.summary import LABEL, estimate, summary_line

__all__ = ["DEFAULT_PROFILE", "LABEL", "PROFILES", "GpuProfile", "estimate", "get_profile", "summary_line"]
