"""Models bigger than RAM: convert a transformers checkpoint directory by streaming its weights.

``source`` reads the directory (config, shard index, safetensors headers) and builds the model with meta
parameters; ``convert`` plans the conversion from the graph and the weights' metadata; ``write`` streams
each weight from its shard, cast, into the outputs (a safetensors directory in the source's layout, a
``.pt2``); ``blockwise`` verifies by running both programs with weights loaded only around their use;
``files`` is what ``amplite convert DIR`` calls. Layer: above ``report``/``onnx`` (it uses ``verify``,
``converter``, ``passes``), below the API.
"""

from amplite.checkpoint.convert import StreamedConversion, convert_checkpoint
from amplite.checkpoint.files import checkpoint_to_files
from amplite.checkpoint.source import is_checkpoint_dir, open_checkpoint

__all__ = ["StreamedConversion", "checkpoint_to_files", "convert_checkpoint", "is_checkpoint_dir", "open_checkpoint"]
