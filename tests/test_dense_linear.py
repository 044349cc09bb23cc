"""kvserve's bf16 and fp32 linear kernels (csrc/dense_linear.cpp) against plain torch, and the
property they exist for: every weight format's linear layer gives a row the same bits
whatever the number of rows in the call (oneDNN's bf16 matmul did not from 32 rows up at
K = 1536, MKL's sgemm at any row count above 1)."""
from __future__ import annotations

import signal

import pytest
import torch

from kvserve import ops, row_table
from kvserve.cpu_features import cpu_info
from kvserve.quant import (Bf16Linear, Fp32Linear, Int4Linear, Int8Linear, Q8Linear, RescoredLMHead,
                           pack_bf16_weight, pack_bf16_weight_reference, unpack_bf16_weight)

pytestmark = pytest.mark.skipif(ops.load_extension() is None, reason="fused kernels disabled")

ROW_COUNTS = (1, 2, 3, 4, 5, 6, 7, 10, 11, 13, 33, 97, 200)  # (10, 11: the AVX2 tiles of 6 + 4 and 6 + 3 + 2 rows)


# The route this process took before any test changed it.
TILE_FREE_ROUTE = ops.load_extension().bf16_kernel_route() if ops.load_extension() is not None else None


def _other_bf16_route(ext) -> str | None:
    """The AVX512 bf16 route this CPU does not take by default, where the build has both."""
    route = ext.bf16_kernel_route()
    other = {"dot": "widened512", "widened512": "dot"}.get(route)
    if other is None:
        return None
    try:
        ext.set_bf16_kernel_route(other)  # the dot route needs AVX512-BF16
    except RuntimeError:
        return None
    finally:
        ext.set_bf16_kernel_route(route)
    return other


# "vector": this machine's own route (on a machine with AMX, its tiles). "other route": on an
# AVX512-BF16 machine, the bf16 route this CPU does not take by default (vdpbf16ps on Intel,
# the widened FMAs on AMD), so that both are checked on either. "tiles": the AMX route's tile
# program on its emulation (amx_linear.cpp), on any CPU.
@pytest.fixture(params=["vector", "other route", "tiles", "portable"])
def portable(request):
    ext = ops.load_extension()
    default_route = ext.bf16_kernel_route()
    if request.param == "tiles":
        ext.set_bf16_kernel_route("amx-emulated")
    if request.param == "other route":
        other = _other_bf16_route(ext)
        if other is None:
            pytest.skip("one bf16 route on this CPU")
        ext.set_bf16_kernel_route(other)
    is_portable = request.param == "portable"
    ext.set_portable_dense_kernels(is_portable)
    ext.set_portable_quant_kernels(is_portable)
    yield is_portable
    ext.set_bf16_kernel_route(default_route)
    ext.set_portable_dense_kernels(False)
    ext.set_portable_quant_kernels(False)


def test_bf16_packing_round_trips():
    w = torch.randn(70, 33)  # ragged: padded to 96 columns and 34 k
    packed = pack_bf16_weight(w)
    assert packed.shape == (3, 17, 32, 2) and packed.dtype == torch.int16
    assert torch.equal(unpack_bf16_weight(packed, 70, 33), w.to(torch.bfloat16))


@pytest.mark.skipif(ops.load_extension() is None, reason="needs the fused CPU kernels")
def test_bf16_packing_kernel_writes_the_reference_bits():
    """The extension's one-pass packer rounds as torch does (ties to even, infinities, -0,
    values past bf16's range) and pads with zeros; a NaN stays a NaN (torch's own bits differ)."""
    torch.manual_seed(5)
    w = torch.randn(70, 33)
    w[4] = 1.0 + 2.0 ** -8  # halfway between two bf16 values: down to the even one
    w[6] = 1.0 + 3 * 2.0 ** -8  # halfway: up to the even one
    w[1, 1], w[2, 2], w[3, 3], w[5, 5] = float("inf"), -0.0, 3.4e38, float("nan")
    pack = ops.load_extension().pack_bf16_weight
    assert unpack_bf16_weight(pack(w), 70, 33)[5, 5].isnan()
    w[5, 5] = 0.0
    assert torch.equal(pack(w), pack_bf16_weight_reference(w))


@pytest.mark.parametrize("n,k", [(96, 64), (70, 33), (40, 576)])
def test_bf16_and_fp32_kernels_match_plain_torch(portable, n, k):
    torch.manual_seed(n + k)
    w, b = torch.randn(n, k) * 0.1, torch.randn(n)
    bf16, fp32 = Bf16Linear(w, b), Fp32Linear(w, b)
    assert bf16.packed
    for rows in ROW_COUNTS:
        x = torch.randn(rows, k)
        ref = bf16.forward_reference(x)
        assert (bf16(x) - ref).abs().max() <= 1e-5 * ref.abs().max(), rows
        ref = x.double() @ w.double().T + b.double()
        assert (fp32(x).double() - ref).abs().max() <= 1e-5 * ref.abs().max(), rows
    with ops.use_kernels(False):  # the plain-torch twins
        assert torch.equal(bf16(x), bf16.forward_reference(x))
        assert torch.equal(fp32(x), torch.nn.functional.linear(x, w, b))


def _layers(n: int, k: int) -> dict[str, torch.nn.Module]:
    torch.manual_seed(k)
    w, b = torch.randn(n, k) * 0.05, torch.randn(n) * 0.1
    return {"bf16": Bf16Linear(w, b), "fp32": Fp32Linear(w, b), "int8": Int8Linear(w, b),
            "int4": Int4Linear.from_float(w, b), "q8": Q8Linear.from_float(w),
            "bf16 head + rescoring": RescoredLMHead(Bf16Linear(w, None), w, top_k=16),
            "q8 head + rescoring": RescoredLMHead(Q8Linear.from_float(w), w, top_k=16)}


# SmolLM2's down projection (K = 1536) and a Gemma-3-like one (K = 2048): the shapes where
# oneDNN's reduction changed with the row count.
@pytest.mark.parametrize("n,k", [(96, 1536), (64, 2048), (160, 576)])
def test_every_format_is_batch_invariant(portable, n, k):
    x = torch.randn(max(ROW_COUNTS), k)
    for name, layer in _layers(n, k).items():
        single = torch.cat([layer(x[i:i + 1]) for i in range(x.shape[0])])
        for rows in ROW_COUNTS[1:]:
            for start in (0, 3):  # and wherever the row sits in the call
                y = layer(x[start:start + rows])
                assert torch.equal(y, single[start:start + rows]), (name, rows, start)


@pytest.fixture
def tile_route():
    """The AMX tile program on its emulation for the test's bf16 calls."""
    ext = ops.load_extension()
    default_route = ext.bf16_kernel_route()
    ext.set_bf16_kernel_route("amx-emulated")
    yield ext
    ext.set_bf16_kernel_route(default_route)


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 40, 130, 300])
def test_tile_route_blocks_every_row_count(tile_route, rows):
    """Partial tiles (fewer than 16 rows: the tiles shrink; a ragged last tile of a larger call:
    its padding rows are computed and dropped), one or two row tiles per block, several blocks
    of 128 rows, a ragged last panel, a bias, a strided output: each row as the portable loop
    computes it, within fp32 rounding (the emulation adds each k pair's products in the same
    order; the portable loop's sum is vectorised), and bit for bit as in a call of its own."""
    torch.manual_seed(rows)
    n, k = 70, 96
    w, b = torch.randn(n, k) * 0.1, torch.randn(n)
    layer, x = Bf16Linear(w, b), torch.randn(rows, k)
    out = torch.full((rows, n + 5), float("nan"))[:, 2:n + 2]
    tile_route.bf16_linear_out(out, x, layer.weight, layer.bias)
    tile_route.set_portable_dense_kernels(True)
    try:
        ref = layer(x)
    finally:
        tile_route.set_portable_dense_kernels(False)
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()
    alone = torch.cat([layer(x[i:i + 1]) for i in range(rows)])
    assert torch.equal(out, alone)


def test_tile_route_leaves_other_depths_on_the_vector_route(tile_route):
    """A tile step takes 32 inputs: a layer whose K is not a multiple (none of the shipped
    models') keeps the vector route for every call, so its rows stay batch invariant too."""
    torch.manual_seed(2)
    layer, x = Bf16Linear(torch.randn(40, 48), None), torch.randn(9, 48)
    tiled = layer(x)
    assert torch.equal(tiled, torch.cat([layer(x[i:i + 1]) for i in range(9)]))
    if TILE_FREE_ROUTE != "amx":  # this machine's vector route, as it runs without tiles
        tile_route.set_bf16_kernel_route(TILE_FREE_ROUTE)
        assert torch.equal(layer(x), tiled)


def test_amx_route_where_the_machine_has_it():
    """The tile route is taken exactly where the CPU, the OS and the forked self-test allow it:
    on every machine whose CPU lists AMX-BF16 (the self-test must pass there), never on the AMD
    and AMX-less Intel machines these tests usually run on: by default, and again after
    set_bf16_kernel_route("auto"); "dot" or "widened" keeps the vector routes there. The self-test's
    own machinery (fork, pipe, comparison, reaping) agrees when the child runs the emulation, also
    with SIGCHLD ignored (the child reaped by the kernel)."""
    ext = ops.load_extension()
    assert ext.amx_bf16_available() == ("amx_bf16" in cpu_info()["features"]), ext.amx_bf16_status()
    assert (TILE_FREE_ROUTE == "amx") == ext.amx_bf16_available()
    before = ext.bf16_kernel_route()
    try:
        ext.set_bf16_kernel_route("auto")
        assert ext.bf16_kernel_route() == TILE_FREE_ROUTE
        if ext.amx_bf16_available():
            ext.set_bf16_kernel_route("widened")
            assert ext.bf16_kernel_route() not in ("amx", "amx-emulated")
    finally:
        ext.set_bf16_kernel_route(before)
    if not ext.amx_bf16_available():
        assert ext.amx_bf16_status() != "available"
        with pytest.raises(RuntimeError, match="the AMX tiles cannot run here"):
            ext.set_bf16_kernel_route("amx")
    assert ext.amx_self_test_machinery()
    previous = signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    try:
        assert ext.amx_self_test_machinery()
    finally:
        signal.signal(signal.SIGCHLD, previous)


@pytest.mark.parametrize("setting", ["bf16_route", "attention_route"])
def test_amx_route_demanded_where_it_cannot_run_fails_clearly(setting):
    """The tiles demanded for the linear layers (set_bf16_kernel_route("amx")) or for attention over
    a bf16 cache (set_attention_kernel_route("amx")) on a machine whose tiles cannot run: the
    setter raises with the reason, instead of running another route's bits, and the route in
    force stays."""
    ext = ops.load_extension()
    if ext.amx_bf16_available():
        pytest.skip("this machine runs the tiles")
    get, set_ = {"bf16_route": (ext.bf16_kernel_route, ext.set_bf16_kernel_route),
                 "attention_route": (ext.attention_kernel_route, ext.set_attention_kernel_route)}[setting]
    before = get()
    try:
        with pytest.raises(RuntimeError, match=f"{setting}=amx, but the AMX tiles cannot run here: .+"):
            set_("amx")
        assert get() == before
    finally:
        set_(before)


def test_gathered_rows_dot_is_fp32_linear_bit_for_bit():
    """The rescored logits of an fp32 head's candidates are the fp32 head's own logits."""
    torch.manual_seed(1)
    w, x = torch.randn(500, 576), torch.randn(5, 576)
    idx = torch.randint(0, 500, (5, 16))
    exact = row_table.gathered_rows_dot(x, w, idx)
    assert torch.equal(exact, Fp32Linear(w, None)(x).gather(1, idx))
    ref = row_table.gathered_rows_dot_reference(x, w, idx)
    assert (exact - ref).abs().max() <= 1e-5 * ref.abs().max()
