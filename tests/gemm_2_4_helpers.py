"""Shared by the 2:4 op's GPU tests (test_gemm_2_4_cuda.py, test_gemm_2_4_wgmma_cuda.py): a
random pruned and packed layer with its exact dequantized weights (one cached at a time), and a
NaN-poisoned allocator block for the next output."""

import torch

from marlin import sparse


class Layer24:
    def __init__(self, k, n, group_size, seed):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        w = sparse.prune_2_4(torch.randn(k, n, device="cuda", generator=gen))
        self.b_q, self.b_meta, self.b_s = sparse.quantize_and_pack_2_4(w, group_size)
        self.w_exact = sparse.unpack_2_4(self.b_q, self.b_meta, self.b_s)  # fp32, exact
        self.w_fp16 = self.w_exact.half()
        self.k, self.n = k, n
        self._w64 = None

    @property
    def w64(self) -> torch.Tensor:
        """The exact weights in float64 (for float64 references)."""
        if self._w64 is None:
            self._w64 = self.w_exact.double()
        return self._w64


_layers = {}


def get_layer(k, n, g) -> Layer24:
    """The layer (K, N, group size g), seeded by its key; only the last one is kept (GPU memory)."""
    key = (k, n, g)
    if key not in _layers:
        _layers.clear()
        torch.cuda.empty_cache()
        _layers[key] = Layer24(k, n, g, seed=hash(key) % 2**31)
    return _layers[key]


def poison_allocator(numel) -> int:
    """The allocator's next block of `numel` halves NaN-filled, so that unwritten outputs show up;
    returns its address (the caller checks that the output landed there)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    t = torch.full((numel,), float("nan"), dtype=torch.float16, device="cuda")
    ptr = t.data_ptr()
    del t
    return ptr
