"""ONNX output: export of a converted program (``export``), cast clean-up (``cleanup``), LayerNorm
islands (``norm``), verification in ONNX Runtime (``verify``) and export-failure diagnosis (``errors``).

Imported only when ONNX is asked for (onnx/onnxscript take seconds to import). Layer: imports
``verify``, ``converter.emit`` and below; never the API, ``report`` or the CLI.
"""
