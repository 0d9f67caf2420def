"""The conversion pipeline's machinery: load a model file, trace it, export → passes → program, emit.

Modules: ``loading`` (model files by content, read through :mod:`amplite.reading`, which checks every
untrusted file before torch deserializes any of it), ``inputs`` (example inputs), ``tracing`` (torch.export),
``calibration`` (FP32 value ranges for the range rules; the ``calibrate`` pass), ``sequence`` (the one
declared sequence of passes ``rewrite`` runs), ``pipeline`` (export, that sequence, the converted program),
``direct`` (that program lifted from the rewritten graph; re-export is the fallback), ``dtype_check`` (the
rewritten graph's real dtypes against the plan: the sequence's postcondition), ``graph_stats``
(cast/FLOP/weight counts), ``emit`` (atomic writes, ``.pt2``).
Layer: imports ``reading``, ``passes``, ``ops``, ``policy``, ``op_tables`` and ``errors`` only; never ``verify``,
``report``, ``onnx``, the API or the CLI.
"""
