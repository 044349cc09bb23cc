"""The conversion pass: a loaded model's linear layers and LM head swapped for a weight
format's (``convert_linear_layers``), a GGUF's matrices read on their own blocks
(``gguf_linear``), the int4 layers' prefill copies, and the streamed weights moved into one
huge-page buffer."""
from __future__ import annotations

import logging
from typing import Iterator, Optional

import numpy as np
import torch
from torch import nn

from kvserve import block_formats, ops
from kvserve.config import INT4_PREFILL_MODES, ConfigError
from kvserve.quant.bf16 import Bf16Linear
from kvserve.quant.common import INT4_GROUP_SIZE, _buffer_bytes
from kvserve.quant.decode_format import DecodeFormatLinear
from kvserve.quant.int8 import Int8Linear
from kvserve.quant.lm_head import SCREEN_GROUP, Q4Screen, RescoredLMHead
from kvserve.quant.q4 import Int4Linear
from kvserve.quant.q8 import Q8Linear
from kvserve.quant.registry import gguf_format, streamed_buffers
from kvserve.quant.segmented import SegmentedLinear
from kvserve.quant.w8a8 import W8A8Linear
from kvserve.row_table import keep_embedding_as_blocks

logger = logging.getLogger(__name__)

WEIGHT_FORMATS = ("bf16", "int8", "int4")


def _gguf_block_linear(quant_type: str, parts: list[np.ndarray], shape: tuple[int, ...],
                       bias: Optional[torch.Tensor]) -> Optional[DecodeFormatLinear]:
    """A GGUF matrix (its row-stacked ``parts``, as the file holds them) read by the kernel for
    its own type (None: no kernel reads that type). The native repacks read the parts in place;
    the numpy unpackers take them concatenated."""
    fmt = gguf_format(quant_type)
    if fmt is None:
        return None
    layer = fmt.from_gguf_raw(parts, quant_type, shape, bias) if fmt.from_gguf_raw is not None else None
    if layer is not None or fmt.from_gguf is None:
        return layer
    data = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return fmt.from_gguf(block_formats.unpack(quant_type, data, shape), shape, bias)


def gguf_linear(raw_parts: list, bias: Optional[torch.Tensor]) -> Optional[DecodeFormatLinear]:
    """The fused projection of ``raw_parts`` (GGUF QuantizedTensors stacked by rows) on the
    file's own blocks: one layer when the parts share a type, a SegmentedLinear of one layer
    per run of parts that share one otherwise; None if some part's type has no kernel."""
    runs: list[list] = []
    for part in raw_parts:
        if runs and runs[-1][0].quant_type == part.quant_type:
            runs[-1].append(part)
        else:
            runs.append([part])
    layers, row = [], 0
    for run in runs:
        rows = sum(p.shape[0] for p in run)
        layer = _gguf_block_linear(run[0].quant_type.name, [p.data for p in run], (rows, run[0].shape[-1]),
                                   None if bias is None else bias[row:row + rows])
        if layer is None:
            return None
        layers.append(layer)
        row += rows
    return layers[0] if len(layers) == 1 else SegmentedLinear(layers)


def format_name(raw_parts: list) -> str:
    """How the start-up line names a layer read on these GGUF parts' own blocks."""
    types = "+".join(dict.fromkeys(p.quant_type.name for p in raw_parts))
    return f"{types} (as stored)"


def convert_linear_layers(model: nn.Module, weight_format: str,
                          raw_weights: Optional[dict] = None, int4_prefill: str = "auto") -> dict[str, int]:
    """Swap the decoder's linear layers and the LM head for ``weight_format`` ones.

    ``int4_prefill`` (INT4_PREFILL_MODES): which int4 layers also get prefill weights for the
    prompt tokens (``DecodeFormatLinear``), in which format: those where a bf16 copy pays here
    ("auto"), all in bf16 ("bf16"), all as byte codes under int8 activations ("int8": faster,
    the activations rounded, see W8A8Linear), or none ("blocks": a draft model, which runs every row through the
    blocks).

    ``raw_weights`` (HF name -> GGUF QuantizedTensor): int4 mode reads a GGUF's own blocks
    where a kernel reads their type (Q4_1, Q4_K, Q5_0, Q8_0, Q6_K: every value as stored), and
    keeps other GGUF matrices at bf16. Float checkpoints are quantized from their values
    (int4: asymmetric min/max per group of 32). int8 is symmetric per output channel.
    The LM head is Q8_0 in int4 mode and bf16 otherwise, with fp32 rescoring of its top
    candidates, and a 4-bit screen for steps that need only the argmax (RescoredLMHead).
    Returns how many layers got each format.
    """
    if weight_format not in WEIGHT_FORMATS:
        raise ConfigError(f"unknown weight format {weight_format!r} (choose from {', '.join(WEIGHT_FORMATS)})")
    if int4_prefill not in INT4_PREFILL_MODES:
        raise ConfigError(f"unknown int4 prefill mode {int4_prefill!r} (choose from {', '.join(INT4_PREFILL_MODES)})")
    packed = getattr(model, "packed_modules", {})
    raw_weights = raw_weights or {}
    counts: dict[str, int] = {}
    prefill_bytes = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or name == "lm_head":
            continue
        if module.weight.device.type != "cpu" and weight_format != "bf16":
            raise ConfigError("int8/int4 weights use CPU kernels; use --device cpu")
        leaf = name.rsplit(".", 1)[-1]
        raw = [raw_weights.get(f"{name.rsplit('.', 1)[0]}.{part}.weight")
               for part in packed.get(leaf, (leaf,))]
        if weight_format == "bf16":
            new, kind = Bf16Linear(module.weight, module.bias), "bf16"
        elif (weight_format == "int4" and all(r is not None for r in raw)
              and (blocks := gguf_linear(raw, module.bias)) is not None):
            new, kind = blocks, format_name(raw)
        elif (weight_format == "int4" and module.in_features % INT4_GROUP_SIZE == 0
              and all(r is None for r in raw)):
            # Float checkpoints (safetensors, test models): quantize afresh.
            new, kind = Int4Linear.from_float(module.weight, module.bias), "int4"
        elif weight_format == "int4":
            # A GGUF matrix in a type no kernel reads (Q5_1, the other K-quants, IQ*):
            # requantizing it to 4 bits loses accuracy (Gemma 3's Q5_0/Q6_K/Q8_0 mix measured
            # 91 % top-1 agreement that way), so it stays at bf16.
            new, kind = Bf16Linear(module.weight, module.bias), "bf16 (no kernel for its type)"
        else:
            new, kind = Int8Linear(module.weight, module.bias), "int8"
        if isinstance(new, DecodeFormatLinear) and int4_prefill == "int8":
            prefill_bytes += new.add_prefill_copy("int8")
        elif isinstance(new, DecodeFormatLinear) and (
                int4_prefill == "bf16" or (int4_prefill == "auto" and new.prefill_copy_pays())):
            prefill_bytes += new.add_prefill_copy("bf16")
        counts[kind] = counts.get(kind, 0) + 1
        parent_name, attr = name.rsplit(".", 1)
        setattr(model.get_submodule(parent_name), attr, new)
    exact = model.lm_head.weight
    on_cpu = exact.device.type == "cpu"
    # Greedy steps rank with a 4-bit screen where the kernel exists (its plain-torch reference
    # is far slower than the head it would replace).
    screen = (Q4Screen.from_float(exact) if on_cpu and exact.shape[1] % SCREEN_GROUP == 0
              and ops.load_extension() is not None else None)
    if weight_format == "int4" and on_cpu and exact.shape[1] % INT4_GROUP_SIZE == 0:
        # Q8_0, llama.cpp's format for SmolLM2's head: half the bytes of bf16 (1.0 against
        # 2.2 ms per token for its 28 M weights).
        model.lm_head, kind = RescoredLMHead(Q8Linear.from_float(exact), exact, screen=screen), "lm_head Q8_0"
    else:
        # bf16 otherwise: the packed bf16 matmul reads the head faster at one row than
        # torch's int8 kernel does (0.9-1.5 ms against 2.0 ms for SmolLM2's 28 M weights).
        model.lm_head, kind = RescoredLMHead(Bf16Linear(exact, None), exact, screen=screen), "lm_head bf16"
    kind += " + fp32 rescoring" + (" + 4-bit argmax screen" if screen is not None else "")
    counts[kind] = 1
    if prefill_bytes:
        logger.info("int4: %s prefill copies of the block-quantized layers for prompt tokens, %.1f MiB",
                    prefill_copy_format(model), prefill_bytes / 2**20)
    _weights_to_huge_pages(model)
    keep_embedding_as_blocks(model)
    return counts


def _prefill_copies(model: nn.Module) -> Iterator[nn.Module]:
    """The prefill copies (Bf16Linear, W8A8Linear) of the model's block-quantized layers."""
    return (m.prefill for m in model.modules() if isinstance(m, DecodeFormatLinear) and m.prefill is not None)


def prefill_copy_bytes(model: nn.Module) -> int:
    """The bytes of the int4 layers' prefill weights (0: none)."""
    return sum(_buffer_bytes(copy) for copy in _prefill_copies(model))


def prefill_copy_format(model: nn.Module) -> Optional[str]:
    """The format of the int4 layers' prefill copies: "bf16", "int8" (or both, "bf16+int8"); None."""
    names = {W8A8Linear: "int8", Bf16Linear: "bf16"}
    return "+".join(sorted({names[type(copy)] for copy in _prefill_copies(model)})) or None


def int8_prompt_layers(model: nn.Module) -> int:
    """How many block-quantized layers compute prompt rows on the int8 prompt path."""
    return sum(1 for m in model.modules() if isinstance(m, DecodeFormatLinear) and m.int8_prompts)


def use_int8_prompts(model: nn.Module) -> int:
    """Put every block-quantized layer of the decoder layers that the int8 prompt kernel reads on
    that path (DecodeFormatLinear.use_int8_prompts); how many took it. The LM head is left as it
    is: it computes only the last prompt row, and the first token comes from it."""
    return sum(1 for name, m in model.named_modules()
               if isinstance(m, DecodeFormatLinear) and ".layers." in f".{name}" and m.use_int8_prompts())


def has_prefill_copies(model: nn.Module) -> bool:
    """Whether some linear layer computes prompt rows in another format than generated ones
    (a prefill copy, or the int8 prompt path)."""
    return any(True for _ in _prefill_copies(model)) or int8_prompt_layers(model) > 0


def _weights_to_huge_pages(model: nn.Module) -> None:
    """Move the block-quantized weights, in module (= reading) order, into one huge-page
    buffer (see ops.copy_to_huge_pages)."""
    slots = [(module, name) for module in model.modules() for name in streamed_buffers(module)
             if getattr(module, name) is not None]
    copies = ops.copy_to_huge_pages([getattr(module, name) for module, name in slots])
    for (module, name), copy in zip(slots, copies):
        setattr(module, name, copy)
