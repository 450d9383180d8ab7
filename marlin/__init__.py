"""marlin: FP16 x INT4 matrix multiplication for LLM inference (the MARLIN kernel) as torch ops.

Ways in:
  * ``torch.ops.marlin.gemm(a, b_q, b_scales)`` (or ``marlin.gemm``): the op itself;
  * ``marlin.packing``: quantize / pack / unpack, the executable spec of the weight format;
  * ``marlin.MarlinLinear`` and ``marlin.replace_linear``: a drop-in for ``nn.Linear``;
  * ``marlin.sparse``, ``torch.ops.marlin.gemm_2_4``, ``marlin.MarlinLinear24``: 2:4-sparse INT4;
  * ``marlin-convert SRC DST``: GPTQ checkpoint conversion.
"""

import torch  # noqa: F401  (loads libc10 and libtorch before the extension)

from . import _C  # noqa: F401  (registers torch.ops.marlin.*)
from . import ops, packing
from .ops import gemm, make_workspace, workspace_size

__version__ = "0.1.0"

__all__ = ["gemm", "workspace_size", "make_workspace", "ops", "packing", "__version__"]

from .nn import MarlinLinear, load_quantized, replace_linear

__all__ += ["MarlinLinear", "replace_linear", "load_quantized"]

from . import sparse  # noqa: E402  (2:4-sparse format: prune, pack, unpack)
from .ops import gemm_2_4  # noqa: E402
from .sparse_nn import MarlinLinear24, replace_linear_2_4  # noqa: E402

__all__ += ["sparse", "gemm_2_4", "MarlinLinear24", "replace_linear_2_4"]

from . import attention  # noqa: E402  (torch.ops.marlin.decode_attention; Triton only at its first CUDA call)
from .decode import compile_for_decode
from .fuse import fuse_projections

__all__ += ["attention", "fuse_projections", "compile_for_decode"]

# transformers' from_pretrained loads Marlin checkpoints once transformers is imported (lazily:
# importing transformers here would cost about a second).
from .integrations import install_transformers_hook as _install_transformers_hook

_install_transformers_hook()

from . import parallel  # noqa: E402  (tensor parallelism on torch.distributed)
from .parallel import tensor_parallel  # noqa: E402

__all__ += ["parallel", "tensor_parallel"]
