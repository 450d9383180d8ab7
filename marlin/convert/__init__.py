"""GPTQ / AWQ -> Marlin checkpoint conversion (library side of the ``marlin-convert`` command).

    from marlin.convert import convert_gptq_checkpoint
    report = convert_gptq_checkpoint("llama-gptq", "llama-marlin", verify=True)
    print(report.summary())

Modules: ``gptq`` and ``awq`` (the source tensor formats and the per-layer conversion), ``checkpoint`` (reading
and writing safetensors directories), ``staging`` (all-or-nothing output directory), ``verify``
(numerical check), ``converter`` (the whole directory), ``cli`` (the command line).
"""

from .converter import ConversionReport, convert_gptq_checkpoint
from .errors import ConversionError

__all__ = ["convert_gptq_checkpoint", "ConversionReport", "ConversionError"]
