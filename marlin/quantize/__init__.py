"""Quantize a model to the Marlin format with the paper's GPTQ variant (``marlin-quantize``).

Modules, one job each: ``hessian`` (H = 2 X^T X from calibration inputs), ``clip`` (the
group-wise clip search), ``gptq`` (GPTQ for one layer), ``calib`` (calibration samples),
``runner`` (a whole model, block by block), ``writer`` (the checkpoint), ``evaluate``
(perplexity), ``cli`` (the command lines).
"""

from .clip import DEFAULT_GRID
from .gptq import GPTQResult, gptq_quantize, rtn_quantize
from .hessian import HessianAccumulator, relative_output_error

__all__ = ["DEFAULT_GRID", "GPTQResult", "gptq_quantize", "rtn_quantize", "HessianAccumulator", "relative_output_error"]
