"""Reports: the conversion/check report document (report.json, schema in ``amplite/schemas``), typed section
by section (``typed``, ``entries``, ``sections``, ``checks``, ``analysis``), and its renderings from the typed
sections: Markdown, HTML (with charts) and JUnit XML plus GitHub annotations.

Layer: imports ``verify`` (metric types), ``converter.emit`` (atomic writes) and below; never the API,
``onnx`` or the CLI.
"""
