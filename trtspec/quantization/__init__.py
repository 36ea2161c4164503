"""Stage 2: quantization passes on the step graph, in the explicit Q/DQ form TensorRT 11 accepts."""

from .calibrate import CalibrationError
from .quantize import BLOCK_SIZES, MODES, quantize
from .report import QuantizationReport
from .rules import qdq_violations

__all__ = ["BLOCK_SIZES", "MODES", "CalibrationError", "QuantizationReport", "qdq_violations", "quantize"]
