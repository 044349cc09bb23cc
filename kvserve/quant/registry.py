"""The weight formats of the linear layers, in one table.

Each format's entry says which layer class holds it, how such a layer is made (from fp32
weights; from a GGUF's blocks, for the GGUF types it reads as stored), which of its buffers a
step streams, and what the native decoder (kvserve/csrc/decoder.cpp, attached by
kvserve/models/fused.py) passes to call it. A layer's format is looked up by its exact class:
the native decoder calls only the layers it knows (a subclass may compute something else).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

from kvserve.quant.bf16 import Bf16Linear
from kvserve.quant.decode_format import DecodeFormatLinear
from kvserve.quant.fp32 import Fp32Linear
from kvserve.quant.int8 import Int8Linear
from kvserve.quant.lm_head import Q4Screen
from kvserve.quant.q4 import Int4Linear, Q5KLinear
from kvserve.quant.q5 import Q5Linear
from kvserve.quant.q6 import Q6KLinear
from kvserve.quant.q8 import Q8Linear
from kvserve.quant.segmented import SegmentedLinear
from kvserve.quant.w8a8 import W8A8Linear

# decoder.cpp's ``Linear``: (kind, weight, scales, bias[, out_features[, prefill[, extra[,
# segments]]]]). out_features where the weight's shape does not say it; prefill: a
# block-quantized layer's copy for the prompt rows, itself such a tuple; extra: Q5_0's fifth
# bits, a W8A8Linear's panels' largest codes; segments: a SegmentedLinear's parts' tuples.
NativeArgs = tuple


@dataclass(frozen=True)
class WeightFormat:
    """One weight format.

    ``native_args(layer)``: decoder.cpp's ``Linear`` for ``layer`` without its prefill copy
    (``native_linear_args`` adds that), or None where the native decoder cannot call it.
    ``from_float``: the layer from fp32 weights (the class's own constructor or ``from_float``;
    with the bias where it takes one). ``gguf_types`` and ``from_gguf(blocks, shape, bias)``:
    the GGUF types this format reads as stored, and the layer from their blocks
    (``block_formats.unpack``'s) for a ``shape`` matrix. ``streamed``: the buffers a step reads,
    in reading order, which ``convert`` moves into huge pages (None-valued ones skipped).
    """

    name: str
    layer: type
    native_args: Callable[[Any], Optional[NativeArgs]]
    from_float: Optional[Callable[..., nn.Module]] = None
    gguf_types: tuple[str, ...] = ()
    from_gguf: Optional[Callable[[Any, tuple[int, ...], Optional[torch.Tensor]], nn.Module]] = None
    # The layer from the tensor's bytes natively, where that applies (None: use from_gguf).
    from_gguf_raw: Optional[Callable[[Any, str, tuple[int, ...], Optional[torch.Tensor]], Optional[nn.Module]]] = None
    streamed: tuple[str, ...] = ()


def _fp32_args(layer: Fp32Linear) -> NativeArgs:
    return "fp32", layer.weight, None, layer.bias


def _plain_fp32_args(layer: nn.Linear) -> Optional[NativeArgs]:
    return ("dense", layer.weight, None, layer.bias) if layer.weight.dtype == torch.float32 else None


def _bf16_args(layer: Bf16Linear) -> NativeArgs:
    if layer.packed:
        return "bf16", layer.weight, None, layer.bias, layer.out_features
    # out_features given: the decoder sizes its buffers from it, and a pre-packed oneDNN
    # weight's shape need not say it.
    return "onednn_bf16" if layer.prepacked else "dense", layer.weight, None, layer.bias, layer.out_features


def _int8_args(layer: Int8Linear) -> Optional[NativeArgs]:
    if layer.weight.shape[1] != layer.in_features:
        return None  # (padded inputs: the decoder passes them as they are; such a model runs layer by layer)
    return "int8", layer.weight, layer.scales, layer.bias


def _w8a8_args(layer: W8A8Linear) -> NativeArgs:
    return "w8a8", layer.weight, layer.affine, layer.bias, layer.out_features, None, layer.largest_codes


def _int4_args(layer: Int4Linear) -> NativeArgs:
    if layer.packed is not None:
        return "tiles", layer.packed, None, layer.bias, layer.out_features, None, None, None
    return "q4", layer.qs, layer.dm, layer.bias, None, None, None, None


def _q5_args(layer: Q5Linear) -> NativeArgs:
    if layer.packed is not None:
        return "tiles", layer.packed, None, layer.bias, layer.out_features, None, None, None
    return "q5", layer.qs, layer.d, layer.bias, None, None, layer.qh, None


def _q6_k_args(layer: Q6KLinear) -> NativeArgs:
    return "tiles", layer.packed, None, layer.bias, layer.out_features, None, None, None


def _q8_args(layer: Q8Linear) -> NativeArgs:
    return "q8", layer.qs, layer.d, layer.bias, None, None, None, None


def _segments_args(layer: SegmentedLinear) -> Optional[NativeArgs]:
    parts = [_block_args(segment) for segment in layer.segments]
    if any(part is None for part in parts):
        return None
    return "segments", None, None, None, layer.out_features, None, None, parts


def _not_native(layer: nn.Module) -> None:
    return None


# ``streamed``: the buffers each format streams per token, in the order a step reads them.
# (oneDNN's pre-packed bf16 weights are opaque tensors that cannot be placed.) (None where the
# layer holds the other layout.) The LM head's screen is read at every greedy argmax-only step:
# on 4 KB pages Gemma 3's 94 MB screen took 1.045x the time (median of 300 calls alternated with
# a huge-page copy, each after a 96 MB flood, Zen 3; SmolLM2's 16 MB: the same).
FORMATS: dict[str, WeightFormat] = {f.name: f for f in (
    WeightFormat("fp32", Fp32Linear, _fp32_args, from_float=Fp32Linear),
    # A plain torch layer: fp32 weights that use_invariant_fp32_linears left to MKL (KernelConfig(batch_invariant=False)).
    WeightFormat("dense", nn.Linear, _plain_fp32_args),
    WeightFormat("bf16", Bf16Linear, _bf16_args, from_float=Bf16Linear),
    WeightFormat("int8", Int8Linear, _int8_args, from_float=Int8Linear),
    WeightFormat("w8a8", W8A8Linear, _w8a8_args, from_float=W8A8Linear.from_float),
    WeightFormat("q4", Int4Linear, _int4_args, from_float=Int4Linear.from_float, gguf_types=("Q4_0", "Q4_1", "Q4_K"),
                 from_gguf=lambda blocks, shape, bias: Int4Linear.from_nibble_blocks(blocks, bias),
                 from_gguf_raw=Int4Linear.from_gguf_raw,
                 streamed=("packed", "qs", "dm")),
    # Q5_K in its own bits where the tiled kernels run (AVX512, AVX2); elsewhere no kernel reads it.
    WeightFormat("q5_k", Q5KLinear, _int4_args, gguf_types=("Q5_K",), from_gguf_raw=Q5KLinear.from_gguf_raw,
                 streamed=("packed",)),
    WeightFormat("q5", Q5Linear, _q5_args, gguf_types=("Q5_0",),
                 from_gguf=lambda blocks, shape, bias: Q5Linear(blocks, shape[-1], bias),
                 streamed=("packed", "qs", "qh", "d")),
    WeightFormat("q8", Q8Linear, _q8_args, from_float=Q8Linear.from_float, gguf_types=("Q8_0",),
                 from_gguf=lambda blocks, shape, bias: Q8Linear.from_byte_blocks(blocks, bias),
                 from_gguf_raw=Q8Linear.from_gguf_raw,
                 streamed=("qs", "d")),
    # Q6_K in its own bits where the AVX512 kernel reads them; elsewhere as Q8Linear's codes.
    WeightFormat("q6_k", Q6KLinear, _q6_k_args, gguf_types=("Q6_K",),
                 from_gguf=lambda blocks, shape, bias: Q8Linear.from_byte_blocks(blocks, bias),
                 from_gguf_raw=lambda data, type_name, shape, bias: (
                     Q6KLinear.from_gguf_raw(data, type_name, shape, bias)
                     or Q8Linear.from_gguf_raw(data, type_name, shape, bias)),
                 streamed=("packed",)),
    WeightFormat("segments", SegmentedLinear, _segments_args),
    # Ranks the LM head's vocabulary (RescoredLMHead calls it; the decoder does not).
    WeightFormat("screen", Q4Screen, _not_native, from_float=Q4Screen.from_float, streamed=("packed",)),
)}
_BY_CLASS = {f.layer: f for f in FORMATS.values()}
_BY_GGUF_TYPE = {t: f for f in FORMATS.values() for t in f.gguf_types}


def format_of(layer: nn.Module) -> Optional[WeightFormat]:
    """``layer``'s weight format (by its exact class), or None."""
    return _BY_CLASS.get(type(layer))


def gguf_format(type_name: str) -> Optional[WeightFormat]:
    """The format that reads GGUF matrices of type ``type_name`` (e.g. "Q5_0") as stored, or None."""
    return _BY_GGUF_TYPE.get(type_name)


def streamed_buffers(module: nn.Module) -> tuple[str, ...]:
    """The names of the buffers ``module`` streams per token, in reading order (see FORMATS)."""
    fmt = format_of(module)
    return () if fmt is None else fmt.streamed


def _block_args(layer: nn.Module) -> Optional[NativeArgs]:
    """A block-quantized layer's native arguments without its prefill copy."""
    fmt = format_of(layer)
    return fmt.native_args(layer) if fmt is not None and issubclass(fmt.layer, DecodeFormatLinear) else None


def native_linear_args(layer: nn.Module) -> Optional[NativeArgs]:
    """What the native decoder needs to call ``layer`` (decoder.cpp's ``Linear``, see NativeArgs),
    a block-quantized layer's prefill copy included; None where it cannot call the layer."""
    fmt = format_of(layer)
    args = None if fmt is None else fmt.native_args(layer)
    if args is None or not isinstance(layer, DecodeFormatLinear):
        return args
    if layer.int8_prompts:
        return (*args[:5], _int8_prompt_args(layer, args), *args[6:])
    if layer.prefill is None:
        return args
    prefill = native_linear_args(layer.prefill)
    return None if prefill is None else (*args[:5], prefill, *args[6:])


def _int8_prompt_args(layer: DecodeFormatLinear, args: NativeArgs) -> NativeArgs:
    """The native arguments of ``layer``'s int8 prompt path (decoder.cpp's "tiles_int8": the same
    tiles through the int8 kernel) from its block arguments ``args``."""
    if isinstance(layer, SegmentedLinear):
        parts = [_int8_prompt_args(segment, part) if segment.int8_prompts else part
                 for segment, part in zip(layer.segments, args[7])]
        return (*args[:7], parts)
    return ("tiles_int8", *args[1:])
