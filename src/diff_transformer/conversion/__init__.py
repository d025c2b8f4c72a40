"""Converting Llama-family checkpoints into Diff checkpoints (docs/design.md, "Converting a Llama checkpoint").

* `convert_llama_to_diff(src, out, diff_version=2, ...)`: Llama -> V2 (function-preserving, default) or V1.
* `convert_diffllama_to_diff(src, out, ...)`: transformers' DiffLlama -> V1, exact.
* `convert_motif_to_diff(src, out, ...)`: Motif (Motif-2.6B, grouped differential attention) -> V1, exact.
* `convert_to_diff(src, out, ...)`: dispatches on SRC's model_type.
* `verify_conversion(src, out, ...)`: max |Δlogit| and greedy agreement of source and result.

All of them raise `ConversionError` (a `ValueError`) with a one-line message for problems with their inputs.
"""

from ..configuration_diff import AUTO_MAP
from .convert import (
    convert_diffllama_to_diff,
    convert_llama_to_diff,
    convert_motif_to_diff,
    convert_to_diff,
)
from .errors import ConversionError
from .verify import verify_conversion


__all__ = [
    "AUTO_MAP",
    "ConversionError",
    "convert_diffllama_to_diff",
    "convert_llama_to_diff",
    "convert_motif_to_diff",
    "convert_to_diff",
    "verify_conversion",
]
