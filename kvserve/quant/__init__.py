"""Weight formats for the linear layers: bf16, INT8 and INT4 weights under fp32 activations.

Decode at small batch reads every weight once per token: it is bound by memory, not compute.
Storing the weights in 16, 8 or 4 bits cuts the bytes read per token 2-8x against fp32, and
bf16 matmuls run at about twice the fp32 rate on CPUs with AVX512-BF16/AMX. The activations
(the residual stream, norms, rope, attention) stay in the model's dtype, fp32 by default:
rounding the residual stream to bf16 at every layer is what costs a bf16 model its accuracy
(top-1 agreement with fp32 drops from 99 % to 95 % on SmolLM2), not the bf16 weights.

int8 uses torch's ``_weight_int8pack_mm`` (per-output-channel scales, bf16 activations).
int4 mode ("the file's own blocks") reads a GGUF's block-quantized matrices as stored, with
kvserve's kernels (kvserve/csrc/quant_linear.cpp, kvserve/block_formats.py): SmolLM2's file is
Q4_1, Gemma 3's a mix of Q5_0, Q8_0, Q4_K and Q6_K; every value is used exactly as llama.cpp
uses it. Float checkpoints are quantized to Q4_1-style groups. The LM head is Q8_0.
The block-quantized weights live in one huge-page buffer in the order a step reads them.

The package: ``common`` (what the formats share), one module per format (``fp32``, ``bf16``,
``int8``, ``w8a8``; the block formats ``decode_format``'s subclasses ``q4``, ``q5``, ``q8``,
``segmented``, with ``nibbles``' tiled layout), ``lm_head`` (the rescored head and its 4-bit
screen), ``registry`` (the table of formats: how each is made, what it streams, what the native
decoder passes to call it) and ``convert`` (the conversion pass). Every public name is
importable from ``kvserve.quant``.
"""
from __future__ import annotations

from kvserve.quant.bf16 import (BF16_PANEL, Bf16Linear, pack_bf16_weight, pack_bf16_weight_reference,
                                unpack_bf16_weight, widened_bf16_kernel)
from kvserve.quant.common import INT4_GROUP_SIZE, batch_invariant_linears
from kvserve.quant.convert import (WEIGHT_FORMATS, convert_linear_layers, gguf_linear, has_prefill_copies,
                                   int8_prompt_layers, prefill_copy_bytes, prefill_copy_format, use_int8_prompts)
from kvserve.quant.decode_format import DecodeFormatLinear
from kvserve.quant.fp32 import Fp32Linear, use_invariant_fp32_linears
from kvserve.quant.int8 import Int8Linear
from kvserve.quant.lm_head import (LM_HEAD_RESCORE_TOP_K, SCREEN_GROUP, SCREEN_TOP_K, Q4Screen, RescoredLMHead,
                                   screen_activations)
from kvserve.quant.nibbles import NIBBLE_TILE_ROWS, quantize_min_max, tile_nibbles, tiled_nibble_kernels, untile_nibbles
from kvserve.quant.q4 import Int4Linear, Q5KLinear
from kvserve.quant.q5 import Q5Linear
from kvserve.quant.q6 import Q6KLinear
from kvserve.quant.q8 import Q8Linear
from kvserve.quant.registry import (FORMATS, WeightFormat, format_of, gguf_format, native_linear_args,
                                    streamed_buffers)
from kvserve.quant.segmented import SegmentedLinear
from kvserve.quant.w8a8 import (W8A8_GROUP, W8A8_OUTLIERS, W8A8_PANEL, W8A8Linear, affine_min_max, pack_w8a8_weight,
                                unpack_w8a8_affine, unpack_w8a8_weight, w8a8_activations)

__all__ = [
    "BF16_PANEL", "FORMATS", "INT4_GROUP_SIZE", "LM_HEAD_RESCORE_TOP_K", "NIBBLE_TILE_ROWS", "SCREEN_GROUP",
    "SCREEN_TOP_K", "W8A8_GROUP", "W8A8_OUTLIERS", "W8A8_PANEL", "WEIGHT_FORMATS", "Bf16Linear", "DecodeFormatLinear",
    "Fp32Linear", "Int4Linear", "Int8Linear", "Q4Screen", "Q5KLinear", "Q5Linear", "Q6KLinear", "Q8Linear", "RescoredLMHead", "SegmentedLinear",
    "W8A8Linear", "WeightFormat", "affine_min_max", "batch_invariant_linears", "convert_linear_layers", "format_of",
    "gguf_format", "gguf_linear", "has_prefill_copies", "int8_prompt_layers", "native_linear_args", "pack_bf16_weight",
    "pack_bf16_weight_reference", "pack_w8a8_weight", "prefill_copy_bytes", "prefill_copy_format", "quantize_min_max",
    "screen_activations", "streamed_buffers", "tile_nibbles", "tiled_nibble_kernels", "unpack_bf16_weight",
    "unpack_w8a8_affine", "unpack_w8a8_weight", "untile_nibbles", "use_int8_prompts", "use_invariant_fp32_linears",
    "w8a8_activations",
    "widened_bf16_kernel",
]
