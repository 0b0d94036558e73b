"""DCP planners for quantized tensors: :class:`QuantizedSavePlanner` and :class:`QuantizedLoadPlanner`."""

from .load import QuantizedLoadPlanner
from .quantize import quantize_state_dict
from .save import QuantizedSavePlanner

__all__ = ["QuantizedSavePlanner", "QuantizedLoadPlanner", "quantize_state_dict"]
