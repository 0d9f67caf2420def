"""The conversion pipeline's machinery: load a model file, trace it, export → passes → program, emit.

Modules: ``loading`` (model files by content), ``archive`` (a .pt2 inspected before anything is
deserialized: zip, JSON, sizes, pickled entries), ``program_strings`` (the program JSON's strings torch
evaluates), ``pt2`` (the .pt2 loader built on it, without
torch.export.load's unpickling paths; ``--import``), ``inputs`` (example inputs), ``tracing`` (torch.export),
``calibration`` (FP32 value ranges for the range rules), ``pipeline`` (export, the pass sequence,
the converted program), ``direct`` (that program lifted from the rewritten graph; re-export is the
fallback), ``dtype_check`` (the rewritten graph's real dtypes against the plan), ``graph_stats``
(cast/FLOP/weight counts), ``emit`` (atomic writes, ``.pt2``).
Layer: imports ``passes``, ``ops``, ``policy``, ``op_tables`` and ``errors`` only; never ``verify``,
``report``, ``onnx``, the API or the CLI.
"""
