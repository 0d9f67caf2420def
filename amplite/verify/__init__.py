"""Verification: does the converted model still compute what the FP32 one does, and where does it not?

Modules: ``compare`` (per-output metrics, tolerances, running a model), ``criteria`` (tolerance specs),
``data`` (batch sources for the gate), ``golden`` (golden references), ``shadow``/``layerwise``/
``node_errors`` (which node introduces error), ``ranges`` (value-range summaries), ``gradcheck``
(gradient comparison), ``converted`` (judging a converted ``.pt2`` given on its own), ``budget`` (the
accuracy-budget search). Layer: imports ``converter`` and below; never the API (``budget`` receives
``convert`` as an argument), ``report``, ``onnx`` or the CLI.
"""
