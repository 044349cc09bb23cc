"""The W8A8 kernel (csrc/w8a8_linear.cpp: int8 weights times int8 activations, int4 mode's
prompt rows on CPUs with AVX512-VNNI) against its plain-torch twin, its two routes against each
other (the same bits), and a row's bits whatever the rows around it."""
from __future__ import annotations

import os

import pytest
import torch

from kvserve import ops
from kvserve.quant import (W8A8Linear, pack_w8a8_weight, unpack_w8a8_scales, unpack_w8a8_weight,
                           w8a8_activations)

pytestmark = pytest.mark.skipif(os.environ.get("KVSERVE_CPU_OPS") == "0", reason="fused kernels disabled")

ROW_COUNTS = (1, 2, 3, 4, 5, 7, 13, 97, 200)
# Ragged N (not a multiple of 16) and K (not of 64); K = 3: fewer inputs than outliers.
SHAPES = [(96, 64), (70, 33), (40, 576), (200, 130), (20, 3)]


@pytest.fixture(params=["vector", "portable"])
def route(request):
    ext = ops.load_extension()
    if request.param == "vector" and ext.w8a8_kernel_route() != "avx512vnni":
        pytest.skip("no AVX512-VNNI route on this CPU")
    ext.set_portable_w8a8_kernel(request.param == "portable")
    yield request.param
    ext.set_portable_w8a8_kernel(False)


def test_packing_round_trips_the_rounded_groups():
    torch.manual_seed(0)
    w = torch.randn(70, 130) * torch.tensor([1e-3, 1.0, 1e2]).repeat_interleave(64)[:130]  # groups far apart
    w[3] = 0.0  # a zero row: scale 0, every integer 0
    packed, scales = pack_w8a8_weight(w)
    assert packed.shape == (5, 48, 16, 4) and packed.dtype == torch.uint8 and scales.shape == (5, 3, 16)
    q = unpack_w8a8_weight(packed, 70, 130)
    group_scales = unpack_w8a8_scales(scales, 80)
    assert q.abs().max() == 127 and torch.equal(q[3], torch.zeros(130, dtype=torch.int32))
    assert torch.equal(group_scales[70:], torch.zeros(10, 3)) and (group_scales[3] == 0).all()
    # Each weight within half a step of its own group's grid (the small groups as exact as the large).
    per_weight = group_scales[:70].repeat_interleave(64, dim=1)[:, :130]
    assert ((q * per_weight - w).abs() <= per_weight / 2 + 1e-9 * w.abs()).all()
    assert (q[:, :64].abs().amax(dim=1)[torch.arange(70) != 3] == 127).all()
    # The padding is a zero weight (128) in every padded column and input.
    full = packed.permute(0, 2, 1, 3).reshape(80, 192)
    assert (full[70:] == 128).all() and (full[:, 130:] == 128).all()


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
    q, scale, index, values = ext.w8a8_activations(x, 192)
    q_ref, scale_ref, index_ref, values_ref = w8a8_activations(x, 192)
    assert torch.equal(q.to(torch.float32), q_ref) and torch.equal(scale, scale_ref)
    assert torch.equal(index, index_ref) and torch.equal(values, values_ref)
    assert index[5].tolist() == [3, 7, 20, 90] and index[6].tolist() == [0, 1, 2, 3]
    assert torch.equal(index[0], x[0].abs().topk(4).indices.sort().values.to(torch.int32))
    assert torch.equal(values, x.gather(1, index.long()))
    assert (q.gather(1, index.long()) == 0).all()  # the outliers are out of the rounded groups
    assert q.abs().max() == 127 and (q[:, 130:] == 0).all() and (q[4] == 0).all()
    # A NaN is an outlier (the largest magnitude), not rounded into its group.
    x_nan = torch.randn(2, 130)
    x_nan[1, 77] = float("nan")
    q, scale, index, values = ext.w8a8_activations(x_nan, 192)
    q_ref, scale_ref, index_ref, _ = w8a8_activations(x_nan, 192)
    assert 77 in index[1].tolist() and torch.equal(index, index_ref) and torch.equal(scale, scale_ref)
    assert torch.equal(q.to(torch.float32), q_ref) and values[1].isnan().sum() == 1
    # Fewer inputs than outliers: every input is one.
    q, scale, index, values = ext.w8a8_activations(torch.tensor([[2.0, -1.0]]), 64)
    assert index.tolist() == [[0, 1]] and values.tolist() == [[2.0, -1.0]] and (q == 0).all()


def test_a_massive_activation_costs_no_precision():
    # One input 1,000x the others (LLMs' "massive activations"): exact as an outlier, it would
    # otherwise set its group's step (the other 63 inputs rounded to about 0).
    torch.manual_seed(2)
    w = torch.randn(64, 576) * 0.05
    layer = W8A8Linear(w, None)
    exact_w = (unpack_w8a8_weight(layer.weight, 64, 576)
               * unpack_w8a8_scales(layer.scales, 64).repeat_interleave(64, dim=1)).float()  # the int8 weights
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
    layer = W8A8Linear(w, b)
    x_all = torch.randn(max(ROW_COUNTS), k)
    alone = torch.cat([layer(x_all[i:i + 1]) for i in range(x_all.shape[0])])
    for rows in ROW_COUNTS:
        x = x_all[:rows]
        y, ref = layer(x), layer.forward_reference(x)
        assert (y - ref).abs().max() <= 1e-5 * ref.abs().max(), rows
        assert torch.equal(y, alone[:rows]), rows  # batch invariant
    # A row's own bits, not only its value, in the middle of another call's rows.
    assert torch.equal(layer(x_all[50:53]), alone[50:53])
    # And close to the float product: int8 rounding of both sides, ~1 % of the largest output.
    exact = x_all @ w.T + b
    assert (alone - exact).abs().max() <= 0.03 * exact.abs().max()


@pytest.mark.parametrize("n,k", SHAPES)
def test_the_routes_give_the_same_bits(n, k):
    ext = ops.load_extension()
    if ext.w8a8_kernel_route() != "avx512vnni":
        pytest.skip("no AVX512-VNNI route on this CPU")
    torch.manual_seed(7)
    layer = W8A8Linear(torch.randn(n, k), None)
    x = torch.randn(37, k)
    vector = layer(x)
    ext.set_portable_w8a8_kernel(True)
    try:
        portable = layer(x)
    finally:
        ext.set_portable_w8a8_kernel(False)
    assert torch.equal(vector, portable)


def test_out_writes_into_a_column_range_and_checks_its_inputs():
    ext = ops.load_extension()
    torch.manual_seed(3)
    layer = W8A8Linear(torch.randn(48, 64), torch.randn(48))
    x = torch.randn(5, 64)
    wide = torch.zeros(5, 100)
    ext.w8a8_linear_out(wide.narrow(1, 20, 48), x, layer.weight, layer.scales, layer.bias)
    assert torch.equal(wide[:, 20:68], layer(x)) and (wide[:, :20] == 0).all() and (wide[:, 68:] == 0).all()
    with pytest.raises(RuntimeError, match="inputs"):
        ext.w8a8_linear(torch.randn(5, 65), layer.weight, layer.scales, 48, None)
    with pytest.raises(RuntimeError, match="output columns"):
        ext.w8a8_linear(x, layer.weight, layer.scales, 70, None)
    with pytest.raises(RuntimeError, match="bias"):
        ext.w8a8_linear(x, layer.weight, layer.scales, 48, torch.randn(47))


def test_without_the_kernels_the_layer_computes_its_reference():
    torch.manual_seed(4)
    layer = W8A8Linear(torch.randn(40, 70), torch.randn(40))
    x = torch.randn(6, 70)
    with ops.use_kernels(False):
        assert torch.equal(layer(x), layer.forward_reference(x))
    assert (layer(x) - layer.forward_reference(x)).abs().max() <= 1e-5 * layer(x).abs().max()

