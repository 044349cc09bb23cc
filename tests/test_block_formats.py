"""GGUF's block formats (Q4_1, Q4_K, Q5_0, Q8_0, Q6_K) as kvserve's kernels read them: the
unpacked values equal gguf's own dequantization bit for bit, each kernel (AVX512, AVX2, portable)
matches plain torch for every row blocking, and a fused projection mixing types computes each
part with its own kernel."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from kvserve import block_formats, ops, quant
from kvserve.block_formats import QuantizedTensor
from kvserve.quant import (DecodeFormatLinear, Int4Linear, Q5Linear, Q8Linear, SegmentedLinear, gguf_linear,
                           tile_nibbles, untile_nibbles)

BLOCK = {T.Q4_1: (32, 20), T.Q5_0: (32, 22), T.Q8_0: (32, 34), T.Q4_K: (256, 144), T.Q5_K: (256, 176),
         T.Q6_K: (256, 210)}


def _fp16_bytes(rng, shape, lo, hi):
    return rng.uniform(lo, hi, size=shape).astype(np.float16).view(np.uint8).reshape(*shape, 2)


def random_blocks(quant_type: T, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random but valid blocks of ``quant_type``: every byte random except the scales, kept
    small and positive so the weights look like a layer's."""
    rng = np.random.default_rng(seed)
    per_block, size = BLOCK[quant_type]
    blocks = rng.integers(0, 256, size=(n, k // per_block, size), dtype=np.uint8)
    shape = (n, k // per_block)
    if quant_type in (T.Q4_1, T.Q5_0, T.Q8_0):
        blocks[..., 0:2] = _fp16_bytes(rng, shape, 0.001, 0.05)
    if quant_type == T.Q4_1:
        blocks[..., 2:4] = _fp16_bytes(rng, shape, -0.4, 0.0)
    if quant_type in (T.Q4_K, T.Q5_K):
        blocks[..., 0:2] = _fp16_bytes(rng, shape, 0.0005, 0.003)
        blocks[..., 2:4] = _fp16_bytes(rng, shape, 0.0005, 0.003)
    if quant_type == T.Q6_K:
        blocks[..., 208:210] = _fp16_bytes(rng, shape, 0.0001, 0.001)
    return blocks.reshape(n, -1)


def reference_weights(quant_type: T, data: np.ndarray, n: int, k: int) -> torch.Tensor:
    return torch.from_numpy(dequantize(data, quant_type).reshape(n, k).astype(np.float32))


@pytest.mark.parametrize("quant_type", list(BLOCK))
def test_unpacked_values_equal_gguf_dequantize(quant_type):
    n, k = 6, 512
    data = random_blocks(quant_type, n, k, seed=int(quant_type))
    layer = gguf_linear([QuantizedTensor(quant_type, data, (n, k))], None)
    assert isinstance(layer, DecodeFormatLinear)
    assert torch.equal(layer.dequantized(), reference_weights(quant_type, data, n, k))


def check_every_row_blocking(layer, k: int, portable: bool, check_rows) -> tuple[torch.Tensor, torch.Tensor]:
    """layer(x) against its plain-torch reference for every row count the kernels block
    differently (1-4 rows together, then the rest), on the vector kernels or the portable loops;
    then check_rows(x, y) for each. Returns the last input and its reference."""
    ext = ops.load_extension()
    ext.set_portable_quant_kernels(portable)
    try:
        for rows in (1, 2, 3, 4, 5, 17):
            x = torch.randn(rows, k)
            y, ref = layer(x), layer.forward_reference(x)
            assert (y - ref).abs().max() <= 1e-5 * ref.abs().max(), rows
            check_rows(x, y)
    finally:
        ext.set_portable_quant_kernels(False)
    return x, ref


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("quant_type,k", [(T.Q4_1, 64), (T.Q4_1, 96), (T.Q4_1, 576), (T.Q5_0, 96), (T.Q5_0, 640),
                                          (T.Q4_K, 512), (T.Q5_K, 512), (T.Q6_K, 512), (T.Q8_0, 640)])
def test_kernel_matches_plain_torch(quant_type, k, portable):
    """Every row count the kernels block differently (1-4 rows together, then the rest), with
    bias; the portable loops (machines without AVX512-BF16) against the same reference. K = 96
    and 576: a row ends in half of the kernel's 128-weight block (96: an odd number of groups,
    padded to 128)."""
    torch.manual_seed(k)
    n = 40  # not a multiple of the 16 rows per task
    data = random_blocks(quant_type, n, k, seed=k)
    layer = gguf_linear([QuantizedTensor(quant_type, data, (n, k))], torch.randn(n))
    w = reference_weights(quant_type, data, n, k)

    def near_exact(x: torch.Tensor, y: torch.Tensor) -> None:
        exact = x.double() @ w.double().T + layer.bias.double()
        rel = (y.double() - exact).norm() / exact.norm()
        assert rel < (1e-6 if isinstance(layer, Q8Linear) else 1e-2), len(x)  # rounded activations (bf16 or int16), but Q8

    x, ref = check_every_row_blocking(layer, k, portable, near_exact)
    with ops.use_kernels(False):
        assert (layer(x) - layer.forward_reference(x)).abs().max() <= 1e-5 * ref.abs().max()


def _fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fp32 a * b + c rounded once: the float64 product is exact, and its sum with c rounds to
    fp32 as one rounding would but for a tie at 2^-29 of the float64 result (none in these
    seeded inputs)."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


@pytest.mark.skipif(not quant.tiled_nibble_kernels(), reason="the tiled nibble kernels (AVX512, AVX2) only")
@pytest.mark.parametrize("quant_type,k", [(T.Q4_1, 576), (T.Q4_1, 96), (T.Q4_K, 512), (T.Q5_0, 640)])
def test_tiled_kernels_are_their_integer_dot_products_and_fp32_steps(quant_type, k):
    """The AVX512 and the AVX2 nibble kernels, emulated: per row and group of 32 inputs the exact
    integer dot product of the values and the activations' 16-bit integers, then
    acc = fma(m, s sum(q), acc) and acc = fma(dot, d s, acc) in fp32, in group order, plus the
    bias. Both ISAs compute exactly this, so a machine of either kind gives the other's bits.
    N = 45: the last tile's upper 8-row half partly filled; K = 96: a zero group past K."""
    n = 45
    data = random_blocks(quant_type, n, k, seed=k)
    layer = gguf_linear([QuantizedTensor(quant_type, data, (n, k))], torch.randn(n, generator=torch.Generator().manual_seed(1)))
    assert layer.packed is not None
    values, d, m = untile_nibbles(layer.packed, n)
    groups = d.shape[1]
    if m is None:  # Q5_0: v = q + 16, w = d v - 16 d
        m = -16.0 * d
    torch.manual_seed(k)
    x = torch.randn(5, k) * torch.logspace(-2, 1, 5)[:, None]
    x[1, :40] = 0.0  # an all-zero group: q = 0, s = 0
    x[2, 32:64] = 1e-36  # largest |x| so small that L / a overflows: q = 0, as for zeros
    padded = torch.nn.functional.pad(x, (0, groups * 32 - k)).view(5, groups, 32)
    largest = padded.abs().amax(-1, keepdim=True)
    # (a tensor divided by a tensor: torch computes a number over a tensor as a reciprocal's product)
    inverse = torch.full_like(largest, ops.ACTIVATION_LEVELS) / torch.where(largest > 0, largest, 1.0)
    inverse = torch.where((largest > 0) & torch.isfinite(inverse), inverse, 0.0)
    q = torch.round(padded * inverse).to(torch.int64)  # fp32 product, ties to even (vcvtps2dq)
    s = (largest[..., 0] / ops.ACTIVATION_LEVELS).numpy()  # [rows, groups]
    s_sum = (largest[..., 0] / ops.ACTIVATION_LEVELS * q.sum(-1).float()).numpy()
    dots = torch.einsum("ngj,rgj->rng", values.view(n, groups, 32).to(torch.int64), q).numpy()  # exact
    d32, m32 = d.numpy().astype(np.float32), m.numpy().astype(np.float32)
    expected = np.zeros((5, n), np.float32)
    for g in range(groups):
        expected = _fma32(m32[None, :, g], s_sum[:, None, g], expected)
        scale = (d32[None, :, g] * s[:, None, g]).astype(np.float32)
        expected = _fma32(dots[:, :, g].astype(np.float32), scale, expected)
    expected = expected + layer.bias.numpy()[None, :]
    for rows in (1, 2, 3, 4, 5):
        assert np.array_equal(layer(x[:rows]).numpy(), expected[:rows]), rows


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("k", [96, 640])
def test_q5_kernel_matches_plain_torch_on_every_machine(k, portable):
    """The 5-bit kernel itself, built directly: every row-count blocking, bias, against the
    plain-torch reference."""
    torch.manual_seed(k)
    n = 40
    data = random_blocks(T.Q5_0, n, k, seed=k)
    layer = Q5Linear(block_formats.unpack("Q5_0", data, (n, k)), k, torch.randn(n))
    assert torch.equal(layer.dequantized(), reference_weights(T.Q5_0, data, n, k))

    def first_row_alone_is_the_same(x: torch.Tensor, y: torch.Tensor) -> None:
        assert torch.equal(layer(x[:1]), y[:1])

    check_every_row_blocking(layer, k, portable, first_row_alone_is_the_same)


def test_row_results_do_not_depend_on_the_rows_beside_them():
    """Determinism: a row computed alone equals the same row in any batch, bit for bit."""
    k = 1024
    for quant_type in (T.Q5_0, T.Q4_K, T.Q6_K, T.Q8_0):
        layer = gguf_linear([QuantizedTensor(quant_type, random_blocks(quant_type, 48, k), (48, k))], None)
        x = torch.randn(11, k)
        together = layer(x)
        for i in range(11):
            assert torch.equal(layer(x[i:i + 1])[0], together[i]), (quant_type, i)


def test_mixed_type_projection_runs_each_part_in_its_own_format():
    """Gemma 3's fused q/k/v with v in Q8_0: one layer per run of same-type parts, equal to the
    parts' weights stacked; the prefill copy covers every row."""
    k = 640
    parts = [QuantizedTensor(T.Q5_0, random_blocks(T.Q5_0, 64, k, 1), (64, k)),
             QuantizedTensor(T.Q5_0, random_blocks(T.Q5_0, 16, k, 2), (16, k)),
             QuantizedTensor(T.Q8_0, random_blocks(T.Q8_0, 16, k, 3), (16, k))]
    layer = gguf_linear(parts, torch.randn(96))
    assert isinstance(layer, SegmentedLinear)
    assert [type(s) for s in layer.segments] == [Q5Linear, Q8Linear]
    w = torch.cat([reference_weights(p.quant_type, p.data, p.shape[0], k) for p in parts])
    assert torch.equal(layer.dequantized(), w)
    x = torch.randn(3, k)
    ref = x @ w.T + layer.bias
    assert ((layer(x) - ref).norm() / ref.norm()) < 5e-3
    assert layer.add_prefill_copy() == 96 * k * 2 + 96 * 4  # bf16 weights, fp32 bias
    assert layer.prefill.out_features == 96
    # The int8 copy: a byte code a weight (96 columns, 640 inputs: no padding), an fp32 scale and
    # offset per column and 32 inputs, the fp32 bias, a byte per panel of 16 columns (its largest
    # code); the formats' values exactly.
    assert layer.add_prefill_copy("int8") == 96 * k + 96 * (k // 32) * 2 * 4 + 96 * 4 + 96 // 16
    assert layer.prefill.out_features == 96 and torch.equal(layer.prefill.weight_values(), w)
    assert ((layer(x) - ref).norm() / ref.norm()) < 5e-3  # no roles: the blocks


def test_same_type_parts_merge_into_one_layer():
    k = 512
    parts = [QuantizedTensor(T.Q4_K, random_blocks(T.Q4_K, 32, k, s), (32, k)) for s in range(2)]
    layer = gguf_linear(parts, None)
    assert isinstance(layer, Int4Linear) and layer.fp32_scales
    assert layer.out_features == 64


@pytest.mark.parametrize("quant_type,k", [(T.Q4_1, 576), (T.Q4_K, 512), (T.Q5_0, 640)])
def test_tiled_layout_puts_each_weight_where_the_vector_kernels_read_it(quant_type, k):
    """tile_nibbles (the AVX512 and AVX2 kernels' layout): row r's value 4 i + c of group g in the low
    nibble of byte 64 i + 4 r % 16 + c of tile r // 16's group g, value 16 + 4 i + c in its
    high nibble; Q5_0's fifth bits at bit 4 (r % 16) + c of mask i (low) or 4 + i (high); then
    the rows' scales. untile_nibbles gives back the same values and scales."""
    n = 37  # the last tile holds 5 rows and 11 of zeros
    blocks = block_formats.unpack(quant_type.name, random_blocks(quant_type, n, k), (n, k))
    if isinstance(blocks, block_formats.Q5Blocks):
        values = torch.from_numpy(block_formats.q5_codes(blocks) + 16).view(n, -1)
        d, m, fp32 = torch.from_numpy(blocks.d.view(np.float16).astype(np.float32)), None, False
    else:
        values, fp32 = torch.from_numpy(blocks.q.astype(np.int32)), blocks.fp32_scales
        d, m = torch.from_numpy(blocks.d), torch.from_numpy(blocks.m)
    packed = tile_nibbles(values, d, m, fp32)
    group_bytes = {T.Q4_1: 320, T.Q4_K: 384, T.Q5_0: 352}[quant_type]
    assert packed.shape == (3, k // 32, group_bytes) and packed.dtype == torch.uint8
    rng = np.random.default_rng(0)
    for r, g, i, c in zip(rng.integers(0, n, 50), rng.integers(0, k // 32, 50), rng.integers(0, 4, 50),
                          rng.integers(0, 4, 50)):
        byte = int(packed[r // 16, g, 64 * i + 4 * (r % 16) + c])
        low, high = int(values[r, 32 * g + 4 * i + c]), int(values[r, 32 * g + 16 + 4 * i + c])
        assert (byte & 15, byte >> 4) == (low & 15, high & 15)
        if quant_type == T.Q5_0:
            masks = packed[r // 16, g, 256:320].numpy().view("<u8")
            bit = int(4 * (r % 16) + c)
            assert (int(masks[i]) >> bit & 1, int(masks[4 + i]) >> bit & 1) == (low >> 4, high >> 4)
    assert not packed[2].reshape(k // 32, -1)[:, :256].reshape(-1, 4, 16, 4)[:, :, 5:].any()  # rows past N
    back, d_back, m_back = untile_nibbles(packed, n)
    assert torch.equal(back, values.int())
    assert torch.equal(d_back, d.float()) and (m_back is None if m is None else torch.equal(m_back, m.float()))


def test_types_without_a_kernel_are_refused():
    k = 256  # (Q3_K: 110 bytes per 256 weights)
    assert block_formats.unpack("Q3_K", np.zeros((1, 110), np.uint8), (1, k)) is None
    assert gguf_linear([QuantizedTensor(T.Q3_K, np.zeros((1, 110), np.uint8), (1, k))], None) is None


@pytest.mark.parametrize("quant_type", list(BLOCK))
@pytest.mark.parametrize("n,blocks", [(6, 2), (3, 1), (70, 3)])  # Q5_0: 1 and 3 groups padded to 64
def test_loader_dequantization_equals_gguf_bit_for_bit(quant_type, n, blocks):
    """The loader's dequantization of the kernels' formats (block_formats + torch, for a fast
    start-up) gives gguf's own values."""
    from kvserve.loader.gguf import dequantize_tensor
    k = blocks * BLOCK[quant_type][0]
    data = random_blocks(quant_type, n, k, seed=k + int(quant_type))
    ours = dequantize_tensor(data, quant_type, (n, k))
    assert ours.dtype == np.float32 and ours.shape == (n, k)
    assert np.array_equal(ours.view(np.uint32), reference_weights(quant_type, data, n, k).numpy().view(np.uint32))
