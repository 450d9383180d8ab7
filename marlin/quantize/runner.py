"""Quantize a transformers decoder model block by block with GPTQ (or round to nearest).

The inputs of block i are the outputs of blocks 0..i-1 *after* they were quantized, so every block
learns to correct the errors of the ones before it, as in GPTQ. Only one block (in float32), its
Hessians and the calibration activations are on ``device`` at a time (with fp_target, below, also
the block's original copy and the full-precision activations); the rest of the model stays
where it was loaded (the CPU).

For each block:
  1. run every calibration sample through it with hooks that add each Linear's inputs to its
     Hessian (marlin.quantize.hessian);
  2. quantize its Linear layers; layers that read the same input (q/k/v, gate/up) have the same
     Hessian and are quantized together as one matrix (GPTQ treats rows independently, so this
     gives the same result in fewer column steps);
  3. put the dequantized weights in the block and run the samples again: these outputs are the
     next block's inputs.

True-sequential (``QuantizeConfig.true_sequential``, on by default): inside a block, the groups of
layers that share an input are quantized in the order the block calls them (Llama: q/k/v, o, gate/up,
down), and each group's Hessian comes from a pass with the groups before it already quantized.
o_proj then learns to correct the error of the quantized q/k/v, down_proj that of gate/up, as the
blocks do for the blocks before them. One sample's pass finds the groups (layers that read the
same tensor) and their order; then each group gets its own pass over the samples, which stops as
soon as every layer of the group has seen its inputs (the q/k/v pass stops at once, the down_proj
pass near the block's end), so each Hessian is computed once.

Full-precision target (``QuantizeConfig.fp_target``): plain GPTQ fits each layer to
X_q W^T, its own full-precision weight on the inputs X_q of the quantized model, so the errors of
earlier layers are carried along, never undone. With fp_target, a second stream of hidden states
runs through the original blocks and each layer is fit to the full-precision model's output
X_fp W^T instead. ||X_q Q^T - X_fp W^T||^2 = ||X_q (Q - W')^T||^2 + const for the least-squares
weight W' = W + D, D^T = (H + lambda I)^-1 X_q^T (X_fp - X_q) W^T * 2/T (ridge-regularised by the
same dampening as GPTQ), so GPTQ quantizes W' with the usual H: the per-layer form of
"asymmetric calibration" (GPTAQ, Li et al. 2025). It costs one more block forward per block and
a second K x K matrix per layer group.

Cost: one pass of each sample through the original block records the full-precision inputs of
every layer (and gives the next block's full-precision hidden states), and the group passes of the
quantized block reuse what an earlier pass of the same sample computed wherever a module's weights
and inputs did not change since (marlin.quantize.replay), so each Linear runs about once per
sample and block. Both give exactly the numbers of running everything again.

The model is left with the dequantized weights in its Linear layers (a "fake-quantized" model
that computes what the Marlin layers will compute), and the results say what to store.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from .. import ops
from ..sparse import SUPPORTED_GROUP_SIZES_2_4, check_shape_2_4
from .clip import DEFAULT_GRID, WeightFormat
from .gptq import SPARSITIES, GPTQResult, gptq_quantize, pruned_fraction, resolve_clip_objective, rtn_quantize
from .hessian import HessianAccumulator, InputBatch, relative_output_error
from .replay import ReplayCache

__all__ = ["QuantizeConfig", "LayerReport", "find_blocks", "quantize_model", "UnsupportedModelError"]

log = logging.getLogger(__name__)

METHODS = ("gptq", "rtn")


class UnsupportedModelError(ValueError):
    """The model is not a decoder stack this runner knows how to walk."""


@dataclass(frozen=True)
class QuantizeConfig:
    """What to do with every Linear layer of the decoder blocks."""

    group_size: int = 128
    act_order: bool = False
    clip: bool = True
    clip_grid: tuple = DEFAULT_GRID
    clip_objective: str = "auto"  # columnwise per column, compensated with groups (marlin.quantize.gptq)
    damp: float = 0.01
    method: str = "gptq"  # or "rtn": round to nearest (no calibration needed for the weights)
    kernel_shapes_only: bool = True  # keep layers the Marlin kernel cannot take in full precision
    bits: int = 4  # 4 or 8
    sym: bool = True  # False: 4-bit with zero points
    sparsity: Optional[str] = None  # "2:4": joint pruning (SparseGPT), MarlinLinear24 weights
    true_sequential: bool = True  # each group of a block on inputs from the quantized groups before it
    fp_target: bool = True  # fit each layer to the full-precision model's outputs (see the module doc)
    clip_shift: bool = False  # zero points: the clip search shrinks each end of the range on its own
    refit: int = 0  # rounds of refitting scales and zero points to GPTQ's codes (marlin.quantize.refit)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method = {self.method!r}, expected one of {METHODS}")
        if self.group_size != -1 and (not isinstance(self.group_size, int) or self.group_size <= 0 or self.group_size % 16):
            raise ValueError(f"group_size = {self.group_size!r}, expected -1 (per column) or a multiple of 16 (32, 64, 128)")
        WeightFormat(self.bits, self.sym)  # ValueError for formats Marlin does not have
        resolve_clip_objective(self.clip_objective, self.group_size)  # ValueError for unknown objectives
        if not isinstance(self.refit, int) or self.refit < 0:
            raise ValueError(f"refit = {self.refit!r}, expected a number of rounds >= 0")
        if self.sparsity is not None:
            if self.sparsity not in SPARSITIES:
                raise ValueError(f"sparsity = {self.sparsity!r}, expected None (dense) or one of {SPARSITIES}")
            if self.bits != 4:
                raise ValueError(
                    f"sparsity 2:4 with bits = {self.bits}: the 2:4 format holds 4-bit weights only (symmetric or with "
                    "zero points)"
                )
            if self.group_size not in SUPPORTED_GROUP_SIZES_2_4:
                raise ValueError(
                    f"sparsity 2:4 with group_size = {self.group_size}: the 2:4 kernel takes group size "
                    f"{', '.join(map(str, SUPPORTED_GROUP_SIZES_2_4[:-1]))} or {SUPPORTED_GROUP_SIZES_2_4[-1]} (-1: per column)"
                )
            if self.act_order:
                raise ValueError("sparsity 2:4 with act_order: the 2:4 format keeps the input order (no permutation)")

    @property
    def block_size(self) -> int:
        """GPTQ's lazy block: 128 columns, or the group size when groups are larger."""
        return max(128, self.group_size)


@dataclass
class LayerReport:
    """One Linear layer: quantized (with its errors) or kept in full precision (with the reason)."""

    name: str
    in_features: int
    out_features: int
    status: str  # "quantized" or "kept"
    reason: str = ""
    error: Optional[float] = None  # relative output error on the calibration data
    rtn_error: Optional[float] = None  # the same for round to nearest, for comparison
    seconds: float = 0.0
    pruned_fraction: Optional[float] = None  # 2:4: ||W at the pruned positions|| / ||W||

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class BlockOutcome:
    """What quantize_model hands to ``on_block_done`` for each finished block."""

    index: int
    results: dict = field(default_factory=dict)  # full layer name -> GPTQResult
    reports: list = field(default_factory=list)  # LayerReport


def find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """(prefix, blocks) of a transformers decoder model: ``model.model.layers`` (Llama, Mistral,
    Qwen2, Gemma, Phi-3, ...) or ``model.transformer.h`` (GPT-2 style)."""
    for base_name, list_name in (("model", "layers"), ("transformer", "h"), ("model.decoder", "layers")):
        try:
            base = model.get_submodule(base_name)
        except AttributeError:
            continue
        blocks = getattr(base, list_name, None)
        if isinstance(blocks, nn.ModuleList) and len(blocks) > 0:
            return f"{base_name}.{list_name}", blocks
    raise UnsupportedModelError(
        f"{type(model).__name__}: no decoder blocks found (expected model.layers, transformer.h or model.decoder.layers "
        "as an nn.ModuleList); marlin-quantize supports transformers causal LMs built as a stack of decoder blocks"
    )


class _Captured(Exception):
    pass


class _Catcher(nn.Module):
    """Stands in for block 0: records the block's call and stops the forward pass there."""

    def __init__(self, store: list):
        super().__init__()
        self.store = store

    def forward(self, *args, **kwargs):
        self.store.append((args, kwargs))
        raise _Captured


def _detach(value):
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, tuple):
        return tuple(_detach(v) for v in value)
    if isinstance(value, list):
        return [_detach(v) for v in value]
    if isinstance(value, dict):
        return {k: _detach(v) for k, v in value.items()}
    return value


@torch.no_grad()
def _capture_block_inputs(model, prefix: str, blocks: nn.ModuleList, samples, device) -> list:
    """The (args, kwargs) of block 0's call for every sample, on ``device``, in float32.

    The blocks are taken out of the model meanwhile, so that moving it to the device moves only
    what runs before block 0 (embeddings, rotary tables) and the small parts after it.
    """
    parent_name, _, attr = prefix.rpartition(".")
    parent = model.get_submodule(parent_name)
    store: list = []
    catcher = _Catcher(store)
    for name in ("attention_type", "layer_idx"):  # read by some models before calling a block
        if hasattr(blocks[0], name):
            setattr(catcher, name, getattr(blocks[0], name))
    setattr(parent, attr, nn.ModuleList([catcher]))
    try:
        model.to(device=device, dtype=torch.float32)
        for ids in samples:
            try:
                model(input_ids=ids.to(device), use_cache=False)
            except _Captured:
                pass
    finally:
        setattr(parent, attr, blocks)
    if len(store) != len(samples):
        raise UnsupportedModelError(
            f"{type(model).__name__} did not call its first decoder block once per sample ({len(store)} calls for "
            f"{len(samples)} samples)"
        )
    return [_detach(call) for call in store]


def _block_output(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _eligible(name: str, layer: nn.Linear, config: QuantizeConfig) -> Optional[str]:
    """Why ``layer`` stays in full precision, or None."""
    k, n = layer.in_features, layer.out_features
    if type(layer) is not nn.Linear:
        return f"{type(layer).__name__} is not a plain nn.Linear"
    if config.group_size != -1 and k % config.group_size:
        return f"in_features = {k} is not a multiple of group_size = {config.group_size}"
    if config.kernel_shapes_only:
        if config.sparsity is not None:
            reason = check_shape_2_4(k, n, config.group_size)
            if reason is not None:
                return f"shape not supported by the 2:4 Marlin kernel: {reason}"
        reason = ops.check_shape(k, n, config.group_size, config.bits)
        if reason is not None:
            return f"shape not supported by the Marlin kernel: {reason}"
    return None


def _quantize_group(
    names: Sequence[str],
    layers: Sequence[nn.Linear],
    h: torch.Tensor,
    config: QuantizeConfig,
    device,
    acc: Optional[HessianAccumulator] = None,
) -> list[GPTQResult]:
    """Quantize layers that share the Hessian ``h`` as one stacked matrix; one result per layer.
    ``acc`` with cross terms: quantize toward the full-precision model's outputs (fp_target).
    The errors in the report are against the layer's own weight on the quantized model's inputs."""
    weights = [layer.weight.detach().to(device, torch.float32) for layer in layers]
    stacked = torch.cat(weights, dim=0)
    if acc is not None and acc.cross is not None and config.method == "gptq":
        stacked = _fp_target(stacked, acc, config.damp)
    fmt = dict(bits=config.bits, sym=config.sym, sparsity=config.sparsity)
    if config.method == "rtn":
        joint = rtn_quantize(stacked, config.group_size, **fmt)
    else:
        joint = gptq_quantize(
            stacked,
            h,
            config.group_size,
            act_order=config.act_order,
            clip=config.clip,
            clip_grid=config.clip_grid,
            clip_objective=config.clip_objective,
            damp=config.damp,
            block_size=config.block_size,
            refit=config.refit,
            clip_shift=config.clip_shift,
            **fmt,
        )
    results, n0 = [], 0
    for w in weights:
        n1 = n0 + w.shape[0]
        res = joint.columns(n0, n1)
        if res.keep is not None:
            res.pruned_fraction = pruned_fraction(w, res.keep)
        res.error = relative_output_error(w, res.dequantized().to(device), h)
        res.rtn_error = relative_output_error(w, rtn_quantize(w, config.group_size, **fmt).dequantized().to(device), h)
        results.append(res)
        n0 = n1
    return results


def _same_input_groups(names: list, hessians: dict) -> list[list[str]]:
    """Layers whose Hessians are identical (they read the same tensor), in block order."""
    groups: list[list[str]] = []
    for name in names:
        for group in groups:
            first = hessians[group[0]]
            if first.tokens == hessians[name].tokens and torch.equal(first.h, hessians[name].h):
                group.append(name)
                break
        else:
            groups.append([name])
    return groups


@torch.no_grad()
def _run_block(block: nn.Module, hidden: list, calls: list, cache: Optional[ReplayCache] = None) -> list:
    """The block's outputs for every sample; with ``cache``, reusing the outputs of submodules
    that an earlier pass of the sample computed with the same weights and inputs (the last pass
    of a block: each sample's entries are dropped after it)."""
    outputs = []
    with cache.installed(block) if cache is not None else contextlib.nullcontext():
        for i, (h, (args, kwargs)) in enumerate(zip(hidden, calls)):
            if cache is not None:
                cache.begin(i)
            outputs.append(_block_output(block(h, *args[1:], **kwargs)))
            if cache is not None:
                cache.drop(i)
    return outputs


@torch.no_grad()
def _reference_pass(block_fp: nn.Module, hidden_fp: list, calls: list, layers: dict) -> tuple[list, dict]:
    """Run every sample through the full-precision block once: (its outputs, {name: [per sample:
    [the inputs of each call of that layer]]}) for the layers named in ``layers`` ({full name:
    name inside the block}). Layers that read the same tensor share it (no copy)."""
    modules = dict(block_fp.named_modules())
    inputs: dict = {name: [] for name in layers}

    def hook(name):
        def record(_module, inp):
            inputs[name][-1].append(inp[0].detach())

        return record

    handles = [modules[local].register_forward_pre_hook(hook(name)) for name, local in layers.items()]
    outputs = []
    try:
        for h, (args, kwargs) in zip(hidden_fp, calls):
            for name in layers:
                inputs[name].append([])
            outputs.append(_block_output(block_fp(h, *args[1:], **kwargs)))
    finally:
        for handle in handles:
            handle.remove()
    return outputs, inputs


@torch.no_grad()
def quantize_model(
    model: nn.Module,
    samples: Sequence[torch.Tensor],
    config: QuantizeConfig,
    *,
    device="cpu",
    done: Optional[dict] = None,
    on_block_done: Optional[Callable[[BlockOutcome], None]] = None,
    progress: bool = True,
    replay_budget_mb: Optional[float] = 4096,
) -> tuple[dict, list]:
    """Quantize every eligible Linear in ``model``'s decoder blocks, in place (fake-quantized).

    ``samples``: calibration token ids, each [1, L] (lengths may differ). ``done``: {block index:
    BlockOutcome} of blocks finished by an earlier, interrupted run; they are not quantized
    again, only their stored weights are put in and run. ``on_block_done`` is called
    after each newly quantized block (the checkpoint writer saves it for resuming).
    ``replay_budget_mb``: at most this much (on ``device``) for the outputs that later passes of a
    block reuse (marlin.quantize.replay; None: no cap, 0: nothing reused); it changes only the
    time, never the result.

    Returns ({layer name: GPTQResult}, [LayerReport]) over all blocks.
    """
    device = torch.device(device)
    prefix, blocks = find_blocks(model)
    if not samples:
        raise ValueError("quantize_model: no calibration samples")
    done = done or {}
    first = next(model.parameters())
    home, home_dtype = first.device, first.dtype
    calls = _capture_block_inputs(model, prefix, blocks, samples, device)
    hidden = [args[0] for args, _ in calls]
    # the full-precision model's hidden states, for fp_target (module doc)
    hidden_fp = list(hidden) if config.fp_target and config.method == "gptq" else None
    all_results: dict = {}
    all_reports: list = []
    bar = tqdm(total=len(blocks), desc=f"marlin-quantize ({config.method})", unit="block", disable=not progress)
    try:
        for index, block in enumerate(blocks):
            block.to(device=device, dtype=torch.float32)
            block_fp = copy.deepcopy(block) if hidden_fp is not None else None  # before any weight changes
            block_prefix = f"{prefix}.{index}"
            linears = {
                f"{block_prefix}.{name}": m for name, m in block.named_modules() if isinstance(m, nn.Linear)
            }
            cache = ReplayCache(None if replay_budget_mb is None else int(replay_budget_mb * 2**20))
            if index in done:
                outcome = done[index]
                for name, res in outcome.results.items():
                    if name not in linears or tuple(linears[name].weight.shape) != (res.q.shape[1], res.q.shape[0]):
                        raise ValueError(f"resume data has layer {name} [{tuple(res.q.shape)}], which block {index} lacks")
                    linears[name].weight.copy_(res.dequantized())
                if block_fp is not None:
                    hidden_fp = _run_block(block_fp, hidden_fp, calls)
            else:
                ref_inputs = None
                if block_fp is not None:
                    # the full-precision inputs of every layer for the cross terms, and the next
                    # block's full-precision hidden states, from one pass (module doc)
                    local = {name: name[len(block_prefix) + 1 :] for name in linears}
                    hidden_fp, ref_inputs = _reference_pass(block_fp, hidden_fp, calls, local)
                outcome = _quantize_block(index, linears, block, hidden, calls, config, device, ref_inputs, cache)
                del ref_inputs  # what the groups left (layers kept in full precision) is not needed
            if block_fp is not None:
                del block_fp
            all_results.update(outcome.results)
            all_reports.extend(outcome.reports)
            hidden = _run_block(block, hidden, calls, cache)  # with the quantized weights
            cache.clear()
            block.to(device=home, dtype=home_dtype)
            if on_block_done is not None and index not in done:
                on_block_done(outcome)
            bar.update(1)
    finally:
        bar.close()
        model.to(device=home, dtype=home_dtype)
    return all_results, all_reports


class _GroupDone(Exception):
    """Raised by a Hessian hook to end a block's pass once its layers have seen their inputs."""


@torch.no_grad()
def _collect_hessians(
    block: nn.Module,
    hidden: list,
    calls: list,
    layers: dict,
    device,
    calls_per_sample: Optional[dict] = None,
    ref_inputs: Optional[dict] = None,
    cache: Optional[ReplayCache] = None,
) -> tuple[dict, dict, list]:
    """Run the block on every sample with hooks on ``layers`` ({name: Linear}).

    Returns ({name: HessianAccumulator}, {name: calls per sample}, [names in order of first call]).
    With ``calls_per_sample`` (from an earlier full pass), a sample's pass ends as soon as every
    one of ``layers`` has been called that many times: what the block computes after them
    cannot change their inputs. ``ref_inputs`` ({name: [per sample: [per call: input]]}, from
    _reference_pass): the same layers' inputs in the full-precision block; the accumulators then
    get the cross terms (HessianAccumulator's ``cross``). ``cache``: reuse what earlier passes of
    the same samples computed (marlin.quantize.replay); the hooked layers always run.
    """
    hessians = {
        name: HessianAccumulator(layer.in_features, device=device, cross=ref_inputs is not None)
        for name, layer in layers.items()
    }
    # the hooks only hand their inputs over; the products are formed for many samples at once,
    # once per tensor that several layers read (marlin.quantize.hessian)
    batch = InputBatch(hessians)
    counts = dict.fromkeys(layers, 0)
    order: list = []
    sample = 0

    def hook(name):
        def record(_module, inp):
            ref = None if ref_inputs is None else ref_inputs[name][sample][counts[name]]
            batch.record(name, inp[0], ref)
            counts[name] += 1
            if name not in order:
                order.append(name)
            if calls_per_sample is not None and all(counts[n] >= calls_per_sample[n] for n in layers):
                raise _GroupDone

        return record

    handles = [layer.register_forward_pre_hook(hook(name)) for name, layer in layers.items()]
    try:
        with cache.installed(block) if cache is not None else contextlib.nullcontext():
            for sample, (h, (args, kwargs)) in enumerate(zip(hidden, calls)):
                counts = dict.fromkeys(layers, 0)
                if cache is not None:
                    cache.begin(sample)
                try:
                    block(h, *args[1:], **kwargs)
                except _GroupDone:
                    pass
                batch.end_call()
    finally:
        for handle in handles:
            handle.remove()
    batch.flush()
    per_sample = dict(counts)  # the last sample's calls (every sample runs the same code)
    return hessians, per_sample, order


@torch.no_grad()
def _probe_groups(block: nn.Module, hidden, call, layers: dict) -> tuple[list, dict]:
    """([groups of layer names that read the same tensor, in the order the block calls them],
    {name: calls per sample}) from one pass of one sample, without Hessians.

    The inputs are kept alive until the pass ends, so a tensor's memory is never reused for
    another one and ``is`` tells the same input from an equal one. Layers the block never calls
    come last, each in its own group.
    """
    inputs: dict = {name: [] for name in layers}
    order: list = []

    def hook(name):
        def record(_module, inp):
            inputs[name].append(inp[0])
            if name not in order:
                order.append(name)

        return record

    handles = [layer.register_forward_pre_hook(hook(name)) for name, layer in layers.items()]
    try:
        args, kwargs = call
        block(hidden, *args[1:], **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    groups: list = []
    for name in order + [n for n in layers if n not in order]:
        for group in groups:
            first = inputs[group[0]]
            if first and len(first) == len(inputs[name]) and all(a is b for a, b in zip(first, inputs[name])):
                group.append(name)
                break
        else:
            groups.append([name])
    return groups, {name: len(seen) for name, seen in inputs.items()}


def _fp_target(weight: torch.Tensor, acc: HessianAccumulator, damp: float) -> torch.Tensor:
    """W' = W + D, D^T = (H + damp * mean(diag H) I)^-1 (C - H) W^T: the weight whose outputs on
    the quantized model's inputs come closest to the full-precision model's (module doc)."""
    h = acc.h
    hd = h + damp * torch.mean(torch.diag(h)).clamp_min(1e-12) * torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    delta = acc.cross - h  # 2/T X_q^T (X_fp - X_q)
    return weight + torch.linalg.solve(hd, delta @ weight.t()).t()


def _quantize_block(
    index,
    linears: dict,
    block,
    hidden,
    calls,
    config: QuantizeConfig,
    device,
    ref_inputs: Optional[dict] = None,
    cache: Optional[ReplayCache] = None,
) -> BlockOutcome:
    outcome = BlockOutcome(index)
    eligible = []
    for name, layer in linears.items():
        why = _eligible(name, layer, config)
        if why is None:
            eligible.append(name)
        else:
            outcome.reports.append(LayerReport(name, layer.in_features, layer.out_features, "kept", reason=why))
            log.warning("marlin-quantize: kept %s in full precision: %s", name, why)
    if not eligible:
        return outcome
    hessians: dict = {}
    if config.true_sequential and config.method == "gptq":
        # one Hessian pass per group, each with the groups before it quantized (module doc)
        groups, per_sample = _probe_groups(block, hidden[0], calls[0], {n: linears[n] for n in eligible})
    else:
        hessians, per_sample, order = _collect_hessians(
            block, hidden, calls, {n: linears[n] for n in eligible}, device, ref_inputs=ref_inputs, cache=cache
        )
        groups = _same_input_groups(eligible, hessians)
        # the order the block calls them (a layer never called keeps its place at the end)
        groups.sort(key=lambda g: min((order.index(n) for n in g if n in order), default=len(order)))
    for group in groups:
        if group[0] not in hessians:
            hessians.update(
                _collect_hessians(
                    block, hidden, calls, {n: linears[n] for n in group}, device, per_sample, ref_inputs, cache
                )[0]
            )
        start = time.perf_counter()
        acc = hessians[group[0]]
        results = _quantize_group(group, [linears[n] for n in group], acc.h, config, device, acc)
        seconds = (time.perf_counter() - start) / len(group)
        for name, res in zip(group, results):
            layer = linears[name]
            layer.weight.copy_(res.dequantized())
            outcome.results[name] = res
            outcome.reports.append(
                LayerReport(
                    name,
                    layer.in_features,
                    layer.out_features,
                    "quantized",
                    error=res.error,
                    rtn_error=res.rtn_error,
                    seconds=seconds,
                    pruned_fraction=res.pruned_fraction,
                )
            )
        for name in group:
            del hessians[name]
            if ref_inputs is not None:
                ref_inputs.pop(name, None)  # this group's full-precision inputs are no longer needed
    return outcome
