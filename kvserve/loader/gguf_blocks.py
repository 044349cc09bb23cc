"""A GGUF model built on its own blocks: the file's format is the engine's format.

No float copy of the model is ever made. Each linear layer is built from its tensor's blocks
(the kernel for its type reads them: Q4_K and Q4_1 as 4-bit tiles, Q5_0, Q8_0 and Q6_K as 8-bit
codes), one tensor at a time, and the file's pages it read are handed back at once
(``GGUFFile.release``), so the process never holds the file and its layers together. The token
embedding and the LM head's exact rows for rescoring are read in place from the mapped file
(``GGUFRows``): only the rows a step reads are ever resident. The LM head's fast copy is the
kernel format of its tensor, its 4-bit screen is built a slice of rows at a time.

A matrix whose type no kernel reads (Q5_K, Q2_K, Q3_K, IQ*) is dequantized and held in bf16
(``Bf16Linear``), and the start-up line counts it.
"""
from __future__ import annotations

import functools
from typing import Optional

import numpy as np
import torch
from torch import nn

from kvserve import ops
from kvserve.config import ModelConfig
from kvserve.loader.gguf import TensorRef, hf_to_gguf_names, quant_type_of, quantized_tensor, release, tensor_values
from kvserve.loader.gguf_reader import GGUFFile
from kvserve.models.registry import get_model_class
from kvserve.quant.bf16 import Bf16Linear
from kvserve.quant.common import read_only_tensor
from kvserve.quant.convert import format_name, gguf_linear
from kvserve.quant.lm_head import SCREEN_GROUP, Q4Screen, RescoredLMHead
from kvserve.quant.q8 import Q8Linear
from kvserve.row_table import GGUFRows

# Rows of the LM head dequantized at a time to build its screen (Llama 3's 128k x 2048: 32 MB).
_SCREEN_SLICE_ROWS = 4096
PLAIN_TYPES = ("F32", "F16", "BF16")


def has_quantized_matrices(gf: GGUFFile) -> bool:
    """Whether the file stores some matrix in a block format (not F32/F16/BF16)."""
    return any(len(info.shape) >= 2 and info.quant_type.name not in PLAIN_TYPES for info in gf.tensors.values())


def _mapped_rows(gf: GGUFFile, gguf_name: str) -> GGUFRows:
    """The tensor's rows in place (the file's pages, read-only)."""
    info = gf.tensors[gguf_name]
    raw = gf.raw(gguf_name).view(np.uint8).reshape(info.shape[0], -1)
    return GGUFRows(read_only_tensor(raw), int(info.quant_type), info.shape[-1],
                    release=functools.partial(gf.release, gguf_name))


def _linear(gf: GGUFFile, config: ModelConfig, gguf_names: list[TensorRef | str],
            bias: Optional[torch.Tensor]) -> tuple[nn.Module, str]:
    """One (fused) projection from its parts' tensors (an expert's: its matrices' slices of the
    expert stacks), on their blocks where a kernel reads them."""
    types = {quant_type_of(gf, n).name for n in gguf_names}
    layer = None
    if not types & set(PLAIN_TYPES):
        parts = [quantized_tensor(gf, config, n) for n in gguf_names]
        layer = gguf_linear(parts, bias)
        kind = format_name(parts)
    if layer is None:  # plain floats, or a block type no kernel reads
        weight = torch.cat([tensor_values(gf, config, n) for n in gguf_names])
        layer = Bf16Linear(weight, bias)
        kind = "bf16" if types <= set(PLAIN_TYPES) else f"bf16 (no kernel for {'+'.join(sorted(types))})"
    for name in gguf_names:
        release(gf, name)
    return layer, kind


def _lm_head(gf: GGUFFile, config: ModelConfig) -> tuple[RescoredLMHead, str]:
    """The head on the output tensor's blocks (the embedding's when tied), with exact rows read in
    place for rescoring and a 4-bit screen for argmax-only steps."""
    name = "token_embd.weight" if config.tie_word_embeddings else "output.weight"
    info = gf.tensors[name]
    exact = _mapped_rows(gf, name) if info.quant_type.name != "F32" else tensor_values(gf, config, name)
    fast, kind = _linear(gf, config, [name], None)  # (hands the tensor's pages back)
    screen = None
    # The screen reads 4.5 bits a weight: it pays against a head of 8-bit codes or bf16 (Q8_0,
    # Q6_K where its tiles are not read, a float head), not against 4-6.6-bit tiles, where it
    # would hold 0.56 bytes a weight more (Llama 3's 128k x 2048 head: 140 MiB, ~2 s of start-up).
    if isinstance(fast, (Q8Linear, Bf16Linear)) and info.shape[-1] % SCREEN_GROUP == 0 and ops.load_extension():
        screen = _screen(gf, name, exact, info.shape[0])
    kind = f"lm_head {kind} + exact rows in place" + (" + 4-bit argmax screen" if screen is not None else "")
    return RescoredLMHead(fast, exact, screen=screen), kind


def _screen(gf: GGUFFile, name: str, exact, rows: int) -> Q4Screen:
    """The head's 4-bit screen, a slice of rows at a time into one buffer, each slice's pages of
    the file handed back as soon as it is packed."""
    packed = None
    row_bytes = gf.tensors[name].nbytes // rows
    for start in range(0, rows, _SCREEN_SLICE_ROWS):
        end = min(rows, start + _SCREEN_SLICE_ROWS)
        ids = torch.arange(start, end)
        part = Q4Screen.from_float(exact(ids) if isinstance(exact, GGUFRows) else exact[ids]).packed
        if packed is None:  # (tiles of 16 rows; the slices hold whole tiles: the packings laid end to end)
            packed = torch.empty((-(-rows // 16),) + tuple(part.shape[1:]), dtype=part.dtype)
        packed[start // 16:start // 16 + part.shape[0]] = part
        gf.release(name, start * row_bytes, end * row_bytes)
    return Q4Screen(packed, rows)


def build_gguf_model(gf: GGUFFile, config: ModelConfig, device: torch.device | str = "cpu") -> tuple[nn.Module, dict]:
    """The model on the file's own blocks (see the module): (model, how many layers got each
    format). CPU only: the kernels that read the blocks are CPU kernels."""
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config)
    packed = getattr(model, "packed_modules", {})
    counts: dict[str, int] = {}
    hf_names = hf_to_gguf_names(gf, config)
    for module_name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or module_name == "lm_head":
            continue
        parent, leaf = module_name.rsplit(".", 1)
        parts = [f"{parent}.{part}" for part in packed.get(leaf, (leaf,))]
        weights = [hf_names[f"{p}.weight"] for p in parts]
        biases = [hf_names.get(f"{p}.bias") for p in parts]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([tensor_values(gf, config, b) for b in biases])
        layer, kind = _linear(gf, config, weights, bias)
        counts[kind] = counts.get(kind, 0) + 1
        setattr(model.get_submodule(parent), leaf, layer)
    decoder = model.model
    embed_name = "token_embd.weight"
    if gf.tensors[embed_name].quant_type.name == "F32":
        decoder.embed_tokens = nn.Embedding.from_pretrained(tensor_values(gf, config, embed_name), freeze=True)
    else:
        decoder.embed_tokens = _mapped_rows(gf, embed_name)
    model.lm_head, kind = _lm_head(gf, config)
    counts[kind] = 1
    # What is left: norms (and any other small float tensor), assigned as fp32 parameters.
    for name, param in list(model.named_parameters()):
        if param.device.type != "meta":
            continue
        gguf_name = hf_names.get(name)
        if gguf_name is None:
            raise ValueError(f"the GGUF file has no tensor for '{name}'")
        module_name, attr = name.rsplit(".", 1)
        setattr(model.get_submodule(module_name), attr, nn.Parameter(tensor_values(gf, config, gguf_name),
                                                                       requires_grad=False))
    for name, buf in list(model.named_buffers()):
        if buf.device.type == "meta":
            raise ValueError(f"buffer '{name}' was not materialised")  # (a model with computed buffers)
    model.requires_grad_(False)
    return model.eval(), counts
