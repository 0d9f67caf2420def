"""amplite inside the training frameworks people already use.

- ``amplite.integrations.lightning.AmplitePrecision``: a Lightning precision plugin
  (``Trainer(plugins=[AmplitePrecision("bf16", "O2")])``).
- ``amplite.integrations.transformers.AmpliteTrainer``: a transformers ``Trainer`` that trains through amplite
  (``TrainingArguments(bf16=True)`` kept, ``Trainer`` -> ``AmpliteTrainer``).

Nothing here imports Lightning or transformers: each framework is imported only by its own submodule, so
``import amplite.integrations`` works without them (install ``amplite[lightning]`` / ``amplite[transformers]``).
Layer: beside ``batch``/``migrate``; imports ``training`` and ``errors``.
"""

from __future__ import annotations

__all__: list[str] = []
