"""The weight-format registry (kvserve.quant.registry): one entry per layer class, the GGUF
types it reads as stored, and the native decoder's arguments."""
import torch
from torch import nn

from kvserve import block_formats
from kvserve.quant import (FORMATS, Bf16Linear, Int4Linear, Q8Linear, SegmentedLinear, format_of, gguf_format,
                           native_linear_args, streamed_buffers)


def test_every_gguf_type_with_a_kernel_has_one_format():
    served = [t for f in FORMATS.values() for t in f.gguf_types]
    assert len(served) == len(set(served))
    # the numpy unpackers' types are read from their blocks; Q5_K only natively (block_repack.cpp)
    from_blocks = [t for t in served if gguf_format(t).from_gguf is not None]
    assert sorted(from_blocks) == sorted(block_formats.UNPACKERS)
    assert set(served) - set(from_blocks) == {"Q5_K"} and gguf_format("Q5_K").from_gguf_raw is not None
    assert gguf_format("Q5_1") is None


def test_layers_made_from_float_find_their_format():
    torch.manual_seed(0)
    weight, bias = torch.randn(48, 64), torch.randn(48)
    for name, fmt in FORMATS.items():
        if fmt.from_float is None:
            continue
        try:
            layer = fmt.from_float(weight, bias)
        except TypeError:  # Q8Linear, Q4Screen: no bias
            layer = fmt.from_float(weight)
        assert format_of(layer) is fmt, name
    assert format_of(nn.Linear(4, 4)) is FORMATS["dense"]
    assert format_of(nn.Module()) is None


def test_native_args_of_a_block_layer_carry_its_prefill_copy():
    torch.manual_seed(0)
    weight = torch.randn(32, 64)
    q4, q8 = Int4Linear.from_float(weight, None), Q8Linear.from_float(weight)
    segmented = SegmentedLinear([q4, q8])
    args = native_linear_args(segmented)
    assert args[0] == "segments" and args[4] == 64 and args[5] is None
    assert args[7] == [native_linear_args(q4), native_linear_args(q8)]
    segmented.add_prefill_copy("bf16")
    with_copy = native_linear_args(segmented)
    assert with_copy[5] == native_linear_args(segmented.prefill) and with_copy[:5] == args[:5]
    assert native_linear_args(nn.Linear(4, 4).half()) is None
    assert streamed_buffers(q8) == ("qs", "d") and streamed_buffers(Bf16Linear(weight, None)) == ()
