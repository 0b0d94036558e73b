"""DCP planners for quantized tensors: :class:`QuantizedSavePlanner` and :class:`QuantizedLoadPlanner`."""

from .load import QuantizedLoadPlanner
from .save import QuantizedSavePlanner

__all__ = ["QuantizedSavePlanner", "QuantizedLoadPlanner"]
