"""Graph passes over a torch.export FX graph: one class per pass, ``__call__(gm) -> PassResult``.

Each module's docstring states what holds after its pass; every rewrite bumps a named counter that
reaches the report. Layer: imports ``ops``, ``policy``, ``op_tables`` and ``errors`` only (plus torch);
nothing above it.
"""
