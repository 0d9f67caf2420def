"""Reading untrusted files safely, apart from converting them.

Every file amplite reads is treated as hostile until checked. ``archive`` inspects a ``.pt2`` before anything is
deserialized (zip structure, sizes, duplicate entries, JSON schema, pickled entries); ``program_strings`` checks
the strings torch would evaluate; ``sym_expr`` parses symbolic size expressions without ``eval``;
``pt2_checks`` validates the program JSON (weights against their metadata, symbols); ``op_allowlist`` the
operators a program calls; ``pt2`` loads the checked archive without torch.export.load's unpickling paths
(``--import``); ``input_files`` reads example-input files (tensors, ``.npz``, ``.safetensors``) with
``weights_only=True``; ``pickles`` tells a damaged pickle from one of classes without unpickling it.
Layer: below the converter, which orchestrates loading and tracing; imports only
``errors`` and ``describe``.
"""
