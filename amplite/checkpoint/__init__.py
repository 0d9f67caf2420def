"""Models bigger than RAM: convert a transformers checkpoint directory by streaming its weights.

``source`` reads the directory (config, shard index, safetensors headers; only files inside it);
``model`` resolves the class from transformers' own registries (no remote code) and builds it on meta
with bounded work; ``keys`` maps shard tensors to the model's parameters with transformers' own
conversions and checks every shape and dtype before anything is written; ``convert`` plans the
conversion from the graph and the weights' metadata; ``result`` is what it returns
(:class:`StreamedConversion`: save, verify); ``write`` streams each weight from its shard, cast, into the
outputs (a safetensors directory in the source's layout, a ``.pt2``); ``blockwise`` verifies by running
both programs with weights loaded only around their use; ``fp8`` plans, calibrates, writes and reads back
FP8 directories in vLLM's layout (``--precision fp8``) and ``fp8_model`` runs one in transformers on the CPU
(dequantized, e4m3 activations simulated); ``files`` is what ``amplite convert DIR`` calls
and ``check`` what ``amplite check DIR`` calls. Layer: above ``report``/``onnx`` (it uses ``verify``,
``converter``, ``passes``), below the API.
"""

from amplite.checkpoint.convert import StreamedConversion, convert_checkpoint
from amplite.checkpoint.files import checkpoint_to_files
from amplite.checkpoint.source import is_checkpoint_dir, open_checkpoint

__all__ = ["StreamedConversion", "checkpoint_to_files", "convert_checkpoint", "is_checkpoint_dir", "open_checkpoint"]
