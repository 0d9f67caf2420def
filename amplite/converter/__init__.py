"""Loading, tracing, the conversion pipeline, emitters, verification and the public API."""
