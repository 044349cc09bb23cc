"""The W8A8 kernel (csrc/w8a8_linear.cpp: the weights' byte codes times int8 activations, int4
mode's prompt rows) against its plain-torch twin, its vector route (AVX512-VNNI or AVX2) against the
portable loop (the same bits), and a row's bits whatever the rows around it."""
from __future__ import annotations


import pytest
import torch
from gguf import GGMLQuantizationType as T

from kvserve import block_formats, ops
from kvserve.quant import (Bf16Linear, Int4Linear, Q5Linear, Q8Linear, SegmentedLinear, W8A8Linear,
                           affine_min_max, pack_w8a8_weight, unpack_w8a8_affine, unpack_w8a8_weight,
                           w8a8_activations)
from test_block_formats import random_blocks

pytestmark = pytest.mark.skipif(ops.load_extension() is None, reason="fused kernels disabled")

ROW_COUNTS = (1, 2, 3, 4, 5, 7, 13, 97, 200)
# Ragged N (not a multiple of 16) and K (not of 32); K = 3: fewer inputs than outliers.
SHAPES = [(96, 64), (70, 33), (40, 576), (200, 130), (20, 3)]


@pytest.fixture(params=["vector", "portable"])
def route(request):
    ext = ops.load_extension()
    if request.param == "vector" and ext.w8a8_kernel_route() == "portable":
        pytest.skip("no vector route on this CPU")
    ext.set_portable_w8a8_kernel(request.param == "portable")
    yield request.param
    ext.set_portable_w8a8_kernel(False)


def test_packing_round_trips_codes_and_constants():
    torch.manual_seed(0)
    codes = torch.randint(0, 256, (70, 130), dtype=torch.int32)
    a, b = torch.rand(70, 5), torch.randn(70, 5)
    packed, affine = pack_w8a8_weight(codes, a, b)
    assert packed.shape == (5, 40, 16, 4) and packed.dtype == torch.uint8 and affine.shape == (5, 5, 2, 16)
    assert torch.equal(unpack_w8a8_weight(packed, 70, 130), codes)
    a_back, b_back = unpack_w8a8_affine(affine, 80)
    assert torch.equal(a_back[:70], a) and torch.equal(b_back[:70], b)
    # The padding is a zero weight: code 0 with a = b = 0, in every padded column and input.
    assert (a_back[70:] == 0).all() and (b_back[70:] == 0).all()
    full = packed.permute(0, 2, 1, 3).reshape(80, 160)
    assert (full[70:] == 0).all() and (full[:, 130:] == 0).all()
    with pytest.raises(ValueError, match="0..255"):
        pack_w8a8_weight(codes + 1, a, b)
    with pytest.raises(ValueError, match="must be"):
        pack_w8a8_weight(codes, a[:, :4], b[:, :4])


def test_min_max_codes_of_float_weights():
    torch.manual_seed(1)
    w = torch.randn(70, 130) * torch.tensor([1e-3, 1.0, 1e2]).repeat_interleave(64)[:130]  # groups far apart
    w[3] = 0.5  # a constant row: step 0, every code 0
    codes, a, b = affine_min_max(w)
    layer = W8A8Linear(codes, a, b, None)
    step = a.repeat_interleave(32, dim=1)[:, :130]
    assert ((layer.weight_values() - w).abs() <= step / 2 + 1e-6 * w.abs()).all()
    assert torch.equal(layer.weight_values()[3], w[3]) and codes.max() == 255 and codes.min() == 0


def test_activations_match_the_plain_torch_rounding():
    torch.manual_seed(1)
    ext = ops.load_extension()
    x = torch.randn(9, 130) * torch.logspace(-3, 3, 130)  # groups of very different magnitudes
    x[4] = 0.0
    x[5] = torch.randn(130) * 0.1
    x[5, 7] = x[5, 90] = x[5, 20] = 50.0  # ties: the lower indices win
    x[5, 100] = -50.0
    x[5, 3] = 50.0
    x[6] = 1.0  # all tied: the first four
    q, scale, index, values, scaled_sum = ext.w8a8_activations(x, 160)
    q_ref, scale_ref, index_ref, values_ref = w8a8_activations(x, 160)
    assert torch.equal(q.to(torch.float32), q_ref) and torch.equal(scale, scale_ref)
    assert torch.equal(scaled_sum, scale * q.view(9, 5, 32).sum(-1).float())
    assert torch.equal(index, index_ref) and torch.equal(values, values_ref)
    assert index[5].tolist() == [3, 7, 20, 90] and index[6].tolist() == [0, 1, 2, 3]
    assert torch.equal(index[0], x[0].abs().topk(4).indices.sort().values.to(torch.int32))
    assert torch.equal(values, x.gather(1, index.long()))
    assert (q.gather(1, index.long()) == 0).all()  # the outliers are out of the rounded groups
    assert q.abs().max() == 127 and (q[:, 130:] == 0).all() and (q[4] == 0).all()
    # A NaN is an outlier (the largest magnitude), not rounded into its group.
    x_nan = torch.randn(2, 130)
    x_nan[1, 77] = float("nan")
    q, scale, index, values, _ = ext.w8a8_activations(x_nan, 160)
    q_ref, scale_ref, index_ref, _ = w8a8_activations(x_nan, 160)
    assert 77 in index[1].tolist() and torch.equal(index, index_ref) and torch.equal(scale, scale_ref)
    assert torch.equal(q.to(torch.float32), q_ref) and values[1].isnan().sum() == 1
    # More NaNs and infs than outliers: those past the outliers read as 0 (the row's outputs are
    # NaN through its NaN outliers).
    x_bad = torch.randn(2, 130)
    x_bad[0, [3, 40, 41, 77, 100, 129]] = float("nan")
    x_bad[1, [5, 6, 70, 71, 72]] = torch.tensor([float("inf"), -float("inf"), float("inf"), float("nan"), 1.0])
    q, scale, index, values, scaled_sum = ext.w8a8_activations(x_bad, 160)
    q_ref, scale_ref, index_ref, values_ref = w8a8_activations(x_bad, 160)
    assert torch.equal(q.to(torch.float32), q_ref) and torch.equal(scale, scale_ref) and torch.equal(index, index_ref)
    assert scale.isfinite().all() and scaled_sum.isfinite().all() and values[0].isnan().all()
    # Fewer inputs than outliers: every input is one.
    q, scale, index, values, _ = ext.w8a8_activations(torch.tensor([[2.0, -1.0]]), 32)
    assert index.tolist() == [[0, 1]] and values.tolist() == [[2.0, -1.0]] and (q == 0).all()
    # The outliers are found among the inputs at least as large as the 4th largest of the
    # maxima of 16 strided lanes: several of the largest in one lane, ties at that bound across
    # lanes and in the tail past the last 16, NaNs in a row of -0.0.
    x = torch.randn(3, 48) * 0.1
    x[0, [1, 17, 33]] = 9.0
    x[0, 47] = -9.0
    x[1, [0, 16, 32, 5, 21, 37]] = 4.0
    x[2] = -0.0
    x[2, [2, 18]] = float("nan")
    _, _, index, _, _ = ext.w8a8_activations(x, 64)
    assert index.tolist() == [[1, 17, 33, 47], [0, 5, 16, 21], [0, 1, 2, 18]]
    assert torch.equal(index, w8a8_activations(x, 64)[2])
    # K around the 16 boundary, each with a row of ties and a NaN in the last input.
    for k in (3, 5, 16, 17, 31):
        x = torch.randn(4, k)
        x[1] = 1.0
        x[2, -1] = float("nan")
        padded = (k + 31) // 32 * 32
        got, want = ext.w8a8_activations(x, padded), w8a8_activations(x, padded)
        assert torch.equal(got[2], want[2]) and torch.equal(got[0].float(), want[0]) and torch.equal(got[1], want[1])
        assert got[2][1].tolist() == list(range(min(4, k))) and (k - 1) in got[2][2].tolist()


def test_a_massive_activation_costs_no_precision():
    # One input 1,000x the others (LLMs' "massive activations"): exact as an outlier, it would
    # otherwise set its group's step (the other 31 inputs rounded to about 0).
    torch.manual_seed(2)
    layer = W8A8Linear.from_float(torch.randn(64, 576) * 0.05, None)
    exact_w = layer.weight_values()
    x = torch.randn(8, 576)
    spiked = x.clone()
    spiked[:, 130] = 1000.0
    exact = spiked @ exact_w.T
    err = (layer(x) - x @ exact_w.T).abs().max()
    assert (layer(spiked) - exact).abs().max() <= 2 * err + 1e-6 * exact.abs().max()


@pytest.mark.parametrize("n,k", SHAPES)
def test_kernel_matches_plain_torch_and_each_row_is_the_same_in_any_call(route, n, k):
    torch.manual_seed(n + k)
    w, b = torch.randn(n, k) * 0.1, torch.randn(n)
    layer = W8A8Linear.from_float(w, b)
    x_all = torch.randn(max(ROW_COUNTS), k)
    alone = torch.cat([layer(x_all[i:i + 1]) for i in range(x_all.shape[0])])
    for rows in ROW_COUNTS:
        x = x_all[:rows]
        y, ref = layer(x), layer.forward_reference(x)
        assert (y - ref).abs().max() <= 1e-5 * ref.abs().max(), rows
        assert torch.equal(y, alone[:rows]), rows  # batch invariant
    # A row's own bits, not only its value, in the middle of another call's rows.
    assert torch.equal(layer(x_all[50:53]), alone[50:53])
    # And close to the float product of its weights: the activations' int8 rounding, ~1 % of the
    # largest output.
    exact = x_all @ layer.weight_values().T + b
    assert (alone - exact).abs().max() <= 0.03 * exact.abs().max()


def _routes_agree(layer: W8A8Linear, x: torch.Tensor) -> None:
    ext = ops.load_extension()
    if ext.w8a8_kernel_route() == "portable":
        pytest.skip("no vector route on this CPU")
    vector = layer(x)
    ext.set_portable_w8a8_kernel(True)
    try:
        portable = layer(x)
    finally:
        ext.set_portable_w8a8_kernel(False)
    assert torch.equal(vector, portable)


@pytest.mark.parametrize("n,k", SHAPES)
def test_the_routes_give_the_same_bits(n, k):
    torch.manual_seed(7)
    _routes_agree(W8A8Linear.from_float(torch.randn(n, k), None), torch.randn(37, k))


def test_the_routes_agree_at_each_codes_largest_int16_sums():
    # The AVX2 route adds vpmaddubsw's int16 pair sums of a group as deep as its panel's largest
    # code allows (codes to 16: 8 quads; 32: 4; 64: 2; 129: 1; past that, as two nibbles): a panel
    # at each bound and one past it, every activation of a group at +-127 with one sign in rows 0
    # and 1, so that every int16 sum is at its largest. Some groups stay below their panel's bound.
    torch.manual_seed(11)
    bounds = (15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 129, 130, 255)
    n, k = 16 * len(bounds), 32 * len(bounds)
    panel = torch.arange(n)[:, None] // 16
    largest = torch.tensor(bounds)[panel].expand(n, k // 32).clone()
    largest[:, 1::3] //= 2
    codes = largest.repeat_interleave(32, dim=1)
    codes[1::2, 1::5] = 0  # the smallest too, in every other column (the rest at their largest)
    layer = W8A8Linear(codes.int(), torch.rand(n, k // 32) + 0.5, torch.randn(n, k // 32), torch.randn(n))
    signs = torch.tensor([1.0, -1.0]).repeat(len(bounds))[:k // 32].repeat_interleave(32)
    x = torch.ones(9, k) * signs  # rows 0 and 1: every group's inputs rounded to 127 of one sign
    x[1] = -x[1]
    x[2:] = torch.randn(7, k)
    x[2:, 7::32] *= 40.0
    _routes_agree(layer, x)
    # The sums are the exact integers: the float64 product of the kernel's own rounding.
    reference = layer.forward_reference(x)
    assert (layer(x).double() - reference).abs().max() <= 1e-5 * reference.abs().max()


@pytest.mark.parametrize("rows", [1, 2, 4, 37])
def test_the_routes_agree_on_each_block_formats_copy(rows):
    # Each format's own codes (Q4_1 to 15, Q5_0 to 31, Q8_0 past 129) with ragged N, through the
    # copies the engine makes.
    layers = [_layer(T.Q4_1, 40, 96, 0), _layer(T.Q5_0, 40, 96, 1), _layer(T.Q8_0, 40, 96, 2)]
    torch.manual_seed(rows)
    x = torch.randn(rows, 96)
    for layer in layers:
        _routes_agree(layer.make_prefill_copy("int8"), x)


def test_out_writes_into_a_column_range_and_checks_its_inputs():
    ext = ops.load_extension()
    torch.manual_seed(3)
    layer = W8A8Linear.from_float(torch.randn(48, 64), torch.randn(48))
    x = torch.randn(5, 64)
    wide = torch.zeros(5, 100)
    ext.w8a8_linear_out(wide.narrow(1, 20, 48), x, layer.weight, layer.affine, layer.bias)
    assert torch.equal(wide[:, 20:68], layer(x)) and (wide[:, :20] == 0).all() and (wide[:, 68:] == 0).all()
    with pytest.raises(RuntimeError, match="inputs"):
        ext.w8a8_linear(torch.randn(5, 65), layer.weight, layer.affine, 48, None)
    with pytest.raises(RuntimeError, match="output columns"):
        ext.w8a8_linear(x, layer.weight, layer.affine, 70, None)
    with pytest.raises(RuntimeError, match="bias"):
        ext.w8a8_linear(x, layer.weight, layer.affine, 48, torch.randn(47))
    # The panels' largest codes: the layer's own, or none (the kernel finds them), never others.
    assert layer.largest_codes.shape == (3,) and torch.equal(layer.largest_codes, layer.weight.view(3, -1).amax(dim=1))
    assert torch.equal(ext.w8a8_linear(x, layer.weight, layer.affine, 48, layer.bias, layer.largest_codes), layer(x))
    with pytest.raises(RuntimeError, match="largest_codes"):
        ext.w8a8_linear(x, layer.weight, layer.affine, 48, None, layer.largest_codes[:2])


def test_without_the_kernels_the_layer_computes_its_reference():
    torch.manual_seed(4)
    layer = W8A8Linear.from_float(torch.randn(40, 70), torch.randn(40))
    x = torch.randn(6, 70)
    with ops.use_kernels(False):
        assert torch.equal(layer(x), layer.forward_reference(x))
    assert (layer(x) - layer.forward_reference(x)).abs().max() <= 1e-5 * layer(x).abs().max()


def _layer(quant_type: T, n: int, k: int, seed: int):
    """A layer holding random valid GGUF blocks of ``quant_type`` (test_block_formats' blocks),
    unpacked as the loader unpacks them."""
    blocks = block_formats.unpack(quant_type.name, random_blocks(quant_type, n, k, seed), (n, k))
    if quant_type in (T.Q4_1, T.Q4_K):
        return Int4Linear.from_nibble_blocks(blocks, None)
    if quant_type == T.Q5_0:
        return Q5Linear(blocks, k, None)
    return Q8Linear.from_byte_blocks(blocks, None)


def test_int8_copies_hold_the_block_formats_weights_exactly():
    # K = 96 for the 32-weight formats: Q5_0's blocks are padded to 128 inputs (a zero 4th group).
    layers = {t.name: _layer(t, 40, 96, seed) for seed, t in enumerate((T.Q4_1, T.Q5_0, T.Q8_0))}
    layers["Q4_K"] = _layer(T.Q4_K, 40, 256, 3)
    layers["Q5_0 + Q8_0"] = SegmentedLinear([layers["Q5_0"], _layer(T.Q8_0, 8, 96, 4)])
    largest_code = {"Q4_1": 15, "Q4_K": 15, "Q5_0": 31, "Q8_0": 255, "Q5_0 + Q8_0": 255}
    for name, layer in layers.items():
        copy = layer.make_prefill_copy("int8")
        assert isinstance(copy, W8A8Linear), name
        assert torch.equal(copy.weight_values(), layer.dequantized()), name
        assert copy.weight.max() <= largest_code[name], name
    # Q6_K's groups of 16 have no 32-input codes: its copy is bf16 (also inside a segmented layer).
    q6_k = _layer(T.Q6_K, 16, 256, 5)
    assert isinstance(q6_k.make_prefill_copy("int8"), Bf16Linear)
    assert isinstance(SegmentedLinear([layers["Q4_K"], q6_k]).make_prefill_copy("int8"), Bf16Linear)
