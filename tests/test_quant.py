"""Unit tests of the weight formats: exact Q4_1 blocks, the Q4_1/Q8_0 kernels against plain
torch, int8, LM-head rescoring and its 4-bit argmax screen."""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

import pytest

from kvserve import ops, row_table
from kvserve.block_formats import unpack_q4_1
from kvserve.config import ConfigError
from kvserve.quant import (SCREEN_TOP_K, Bf16Linear, Int4Linear, Int8Linear, Q4Screen, Q8Linear, RescoredLMHead,
                           quantize_min_max, unpack_bf16_weight)
from kvserve.token_roles import ALL_GENERATED, ALL_PROMPT, MIXED, TokenRoles, use_token_roles


def _random_q4_1(n: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    blocks = np.zeros((n, k // 32, 20), dtype=np.uint8)
    d = rng.uniform(0.001, 0.05, size=(n, k // 32)).astype(np.float16)
    m = rng.uniform(-0.4, 0.0, size=(n, k // 32)).astype(np.float16)
    blocks[..., 0:2] = d.view(np.uint8).reshape(n, k // 32, 2)
    blocks[..., 2:4] = m.view(np.uint8).reshape(n, k // 32, 2)
    blocks[..., 4:] = rng.integers(0, 256, size=(n, k // 32, 16), dtype=np.uint8)
    return blocks.reshape(n, -1)


def test_unpack_q4_1_matches_gguf_dequantize():
    raw = _random_q4_1(8, 64)
    b = unpack_q4_1(raw, (8, 64))
    ours = (b.q.reshape(8, 2, 32) * b.d[..., None] + b.m[..., None]).reshape(8, 64)
    ref = dequantize(raw, GGMLQuantizationType.Q4_1).reshape(8, 64)
    assert np.array_equal(ours.astype(np.float32), ref.astype(np.float32))


def test_int4_from_q4_1_matches_fp32_linear():
    n, k = 96, 128
    raw = _random_q4_1(n, k, seed=1)
    layer = Int4Linear.from_nibble_blocks(unpack_q4_1(raw, (n, k)), None)
    w = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_1)).view(n, k).float()
    x = torch.randn(5, k)
    rel = (layer(x) - x @ w.T).norm() / (x @ w.T).norm()
    assert layer(x).dtype == torch.float32
    assert rel < 5e-3  # bf16 activations; the 4-bit values and fp16 scales are the file's


def test_int4_prefill_auto_keeps_the_copies_where_they_pay():
    """int4_prefill "auto": the Q8 kernel (Q8_0, Q6_K) always keeps a bf16 copy for prompt rows, and
    so does a segmented projection with such a part; the 4-bit layers drop theirs only where
    the AVX512 tiles run against kvserve's bf16 kernel on its widened route (Intel's cores)."""
    from kvserve.quant import SegmentedLinear

    torch.manual_seed(0)
    q4, q8 = Int4Linear.from_float(torch.randn(32, 64), None), Q8Linear.from_float(torch.randn(16, 64))
    assert q8.prefill_copy_pays() and SegmentedLinear([q4, q8]).prefill_copy_pays()
    ext = ops.load_extension()
    route = None if ext is None else ext.bf16_kernel_route()
    tiles_win = ops.nibble_kernel_isa() == "avx512" and route == "widened512"
    assert q4.prefill_copy_pays() == (not tiles_win)
    assert SegmentedLinear([q4, Int4Linear.from_float(torch.randn(16, 64), None)]).prefill_copy_pays() == (not tiles_win)
    if route in ("dot", "widened512"):  # the other AVX512 route (Zen 4's, vdpbf16ps): copies stay
        ext.set_bf16_kernel_route("dot")
        try:
            assert q4.prefill_copy_pays()
        finally:
            ext.set_bf16_kernel_route(route)


@pytest.mark.parametrize("kernels", [True, False])
def test_int4_prefill_copy_gives_each_row_the_format_of_its_role(kernels):
    """A mixed step (one request's prompt rows, another's generated rows, in any order): each
    prompt row is what the bf16 copy gives that row alone, each generated row what the Q4_1
    blocks give it alone, bit for bit with kvserve's kernels; without roles (a draft model, a direct call) every row
    is Q4_1 as before."""
    n, k = 40, 96  # 96: an odd number of groups, padded to 128 in the blocks, not in the copy
    raw = _random_q4_1(n, k, seed=3)
    layer = Int4Linear.from_nibble_blocks(unpack_q4_1(raw, (n, k)), torch.randn(n))
    w = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_1)).view(n, k).float()
    assert torch.equal(layer.dequantized(), w)
    copy_bytes = layer.add_prefill_copy()
    bias = layer.prefill.bias  # (the copy keeps its own, fp32 on the kernels' route)
    assert copy_bytes == layer.prefill.weight.numel() * 2 + bias.numel() * bias.element_size()
    if layer.prefill.packed:
        assert torch.equal(unpack_bf16_weight(layer.prefill.weight, n, k), w.to(torch.bfloat16))
    x = torch.randn(9, k)
    masks = {
        "interleaved": [0, 1, 1, 0, 1, 0, 0, 1, 0],  # rows gathered
        "decodes then a prefill": [0, 0, 0, 1, 1, 1, 1, 1, 1],  # one run per role
        "all prompt": [1] * 9,
        "all generated": [0] * 9,
    }
    with ops.use_kernels(kernels):
        for name, mask in masks.items():
            roles = TokenRoles.from_mask(np.array(mask, dtype=bool))
            assert roles.kind == {"all prompt": ALL_PROMPT, "all generated": ALL_GENERATED}.get(name, MIXED)
            with use_token_roles(roles):
                y = layer(x)
            for i, prompt in enumerate(mask):
                alone = (layer.prefill if prompt else layer.forward_blocks)(x[i:i + 1])
                ref = (layer.prefill.forward_reference if prompt else layer.forward_reference)(x[i:i + 1])
                assert (alone - ref).abs().max() <= 1e-5 * ref.abs().max(), (name, i)
                if kernels:  # kvserve's kernels reduce a row alike in any call (plain torch's BLAS need not)
                    assert torch.equal(y[i], alone[0]), (name, i)
                else:
                    assert (y[i] - alone[0]).abs().max() <= 1e-5 * ref.abs().max(), (name, i)
        # The two formats differ (bf16 rounding of d * q + m), so the roles do choose.
        assert not torch.equal(layer.prefill(x), layer.forward_blocks(x))
        assert torch.equal(layer(x), layer.forward_blocks(x))


@pytest.mark.parametrize("portable", [False, True])
def test_q8_0_requantizes_gguf_blocks_exactly_and_kernel_matches(portable):
    rng = np.random.default_rng(3)
    n, k = 50, 128
    blocks = np.zeros((n, k // 32, 34), dtype=np.uint8)
    blocks[..., 0:2] = rng.uniform(0.001, 0.02, size=(n, k // 32)).astype(np.float16).view(np.uint8).reshape(n, -1, 2)
    q = rng.integers(-127, 128, size=(n, k // 32, 32), dtype=np.int8)
    q[..., 0] = 127  # Q8_0 blocks reach +-127: d = max |w| / 127
    blocks[..., 2:] = q.view(np.uint8)
    w = torch.from_numpy(dequantize(blocks.reshape(n, -1), GGMLQuantizationType.Q8_0)).view(n, k).float()
    head = Q8Linear.from_float(w)
    assert torch.equal(head.qs, torch.from_numpy(q.reshape(n, k)))
    ext = ops.load_extension()
    ext.set_portable_quant_kernels(portable)
    try:
        for rows in (1, 3, 6):
            x = torch.randn(rows, k)
            ref = x.double() @ w.double().T
            assert (head(x).double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    finally:
        ext.set_portable_quant_kernels(False)
    with ops.use_kernels(False):
        assert (head(x).double() - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_int4_from_float_and_int8_error_bounds():
    torch.manual_seed(0)
    w = torch.randn(64, 128) * 0.05
    b = torch.randn(64)
    x = torch.randn(3, 128)
    ref = x @ w.T + b
    for layer, bound in [(Int4Linear.from_float(w, b), 0.1), (Int8Linear(w, b), 0.02), (Bf16Linear(w, b), 0.01)]:
        rel = (layer(x) - ref).norm() / ref.norm()
        assert rel < bound, (type(layer).__name__, rel.item())


def test_rescored_head_gives_fp32_logits_for_top_candidates():
    torch.manual_seed(0)
    w = torch.randn(1000, 64)
    x = torch.randn(4, 64)
    head = RescoredLMHead(Bf16Linear(w, None), w, top_k=8)
    logits = head(x)
    exact = x @ w.T
    # The best few are inside the cheap head's top 8 and so carry exact fp32 logits.
    top = exact.topk(4, dim=-1).indices
    assert torch.allclose(logits.gather(1, top), exact.gather(1, top), atol=1e-5)
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))


# (70001, 64): logits past 2 MB from 8 rows up, which the VNNI kernel writes with non-temporal
# stores (in one block of rows and in several, beside a partial last tile; fewer rows below it
# with plain ones).
@pytest.mark.parametrize("n,k", [(100, 64), (37, 192), (2000, 576), (70001, 64)])
def test_q4_screen_kernel_matches_its_reference_and_its_portable_loop(n, k):
    """The screen's kernels (AVX512-VNNI, AVX2 or the portable loop, whichever this CPU has)
    compute the same integer sums and the same two FMAs per group: bit-identical to each
    other, equal to the plain-torch reference to rounding, and independent of the row count
    (N not a multiple of the 16-row tile, K of 64) and of how the logits are stored."""
    torch.manual_seed(0)
    screen = Q4Screen.from_float(torch.randn(n, k) * 0.05)
    assert screen.packed.shape == (-(-n // 16), k // 64, 576)
    x = torch.randn(19, k) * 3  # blocks of 8 activation rows (VNNI) or 4 (AVX2), and a rest
    ext = ops.load_extension()
    y = screen(x)
    ref = screen.forward_reference(x)
    assert (y - ref).abs().max() <= 1e-5 * ref.abs().max()
    ext.set_portable_screen_kernel(True)
    try:
        assert torch.equal(screen(x), y)
    finally:
        ext.set_portable_screen_kernel(False)
    for rows in (1, 2, 5, 8, 9):
        assert torch.equal(screen(x[:rows]), y[:rows])
    out = torch.full((19, n), float("nan"))
    assert screen(x, out=out) is out and torch.equal(out, y)
    misaligned = torch.full((19, n + 1), float("nan"))[:, 1:]  # most rows off the 64-byte grid: plain stores
    assert torch.equal(screen(x, out=misaligned), y)


def test_q4_screen_holds_min_max_groups_of_64():
    """The screen's weights are quantize_min_max's at 4 bits per 64 inputs (its blocks read back
    exactly), and it needs K divisible by 64."""
    torch.manual_seed(7)
    w = torch.randn(37, 192) * torch.tensor([0.01, 1.0, 0.1]).repeat_interleave(64)
    screen = Q4Screen.from_float(w)
    for got, expected in zip(screen._blocks(), quantize_min_max(w, 4, 64)):
        assert torch.equal(got.float(), expected.float())
    with pytest.raises(ConfigError, match="divisible by 64"):
        Q4Screen.from_float(torch.randn(8, 96))


@pytest.mark.skipif(ops.load_extension() is None, reason="needs the fused CPU kernels")
def test_q4_screen_pack_kernel_writes_the_reference_bytes():
    """The extension's one-pass packer writes pack_reference's bytes: partial last tile, scales
    from 1e-4 to 1e3, a constant group (d at its 1e-6 floor), ties at half a step, a large
    outlier, and a minimum and a range past fp16's (m or d infinite)."""
    torch.manual_seed(3)
    w = torch.randn(53, 320) * torch.tensor([1e-4, 0.05, 1.0, 30.0, 1e3]).repeat_interleave(64)
    w[4, :64] = 0.25
    w[9, 64:128] = (torch.arange(64) % 31) * 0.5  # 0 to 15: d = 1 exactly, ties at every half
    w[11, 7] = 6e4
    w[12, 3] = -7e4  # m = -inf
    w[13, 70] = 2e6  # (hi - lo) / 15 past 65504: d = inf
    assert torch.equal(ops.load_extension().q4_screen_pack(w), Q4Screen.pack_reference(w))


@pytest.mark.skipif(ops.load_extension() is None, reason="needs the fused CPU kernels")
def test_q8_0_quantize_kernel_gives_the_reference_blocks():
    """Q8Linear.from_float's one-pass kernel (8 lanes at a time with AVX2): the reference's codes
    and scales, zero groups, subnormal groups, a scale past fp16's range (d = inf), infinite
    weights, negative zeros, values near ties."""
    torch.manual_seed(4)
    w = torch.randn(37, 96) * torch.tensor([1e-3, 0.05, 20.0]).repeat_interleave(32)
    w[0, :32], w[1, :32], w[2, :32] = 0.0, 1e-40, 7e4
    w[4, 64:96] = 1e7  # amax / 127 past 65504
    w[3, 32:64] = torch.arange(32) - 15.5  # amax 15.5: d = fp16(15.5 / 127), codes near ties
    w[5, 3], w[6, 40] = float("inf"), float("-inf")  # d = inf: inf / inf, a NaN code (0)
    w[7, 10:20] = -0.0
    qs, d = ops.load_extension().q8_0_quantize(w)
    reference_qs, reference_d = Q8Linear.quantize_reference(w)
    assert torch.equal(qs, reference_qs) and torch.equal(d, reference_d)


def test_q4_screen_approximates_the_weights_it_was_built_from():
    """4-bit weights (as Int4Linear.from_float) and int8 activations: a coarse copy of x @ W^T."""
    torch.manual_seed(1)
    w, x = torch.randn(500, 128) * 0.05, torch.randn(3, 128)
    exact = x @ w.T
    rel = (Q4Screen(Q4Screen.from_float(w).packed, 500)(x) - exact).norm() / exact.norm()
    assert rel < 0.1, rel.item()


def test_rescored_head_argmax_only_ranks_with_the_screen_and_keeps_fp32_argmax():
    """In argmax-only mode the screen's best SCREEN_TOP_K get fp32 logits and every other
    logit is -inf: the argmax is the fp32 head's."""
    torch.manual_seed(2)
    w = torch.randn(5000, 64)
    x = torch.randn(7, 64)
    head = RescoredLMHead(Bf16Linear(w, None), w, screen=Q4Screen.from_float(w))
    exact = x @ w.T
    logits = head(x, argmax_only=True)
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))
    assert (logits.isfinite().sum(-1) == SCREEN_TOP_K).all()
    kept = logits.isfinite()
    assert torch.allclose(logits[kept], exact[kept], atol=1e-5)
    # Without the flag the head is the usual one (no -inf).
    assert head(x).isfinite().all()


@pytest.mark.skipif(ops.load_extension() is None, reason="needs the fused CPU kernels")
def test_rescored_head_argmax_only_in_one_call_matches_the_separate_kernels():
    """The argmax-only head runs as one native call (screened_logits_out): the same logits, bit
    for bit, as the screen, the top-k, the fp32 rescoring and the -inf fill called one by one."""
    torch.manual_seed(5)
    w = torch.randn(4001, 128)  # a partial last tile of the screen
    head = RescoredLMHead(Bf16Linear(w, None), w, screen=Q4Screen.from_float(w))
    for rows in (1, 5, 11):
        x = torch.randn(rows, 128)
        screen = head.screen(x)
        idx = ops.top_k(screen, SCREEN_TOP_K)[1]
        expected = torch.full_like(screen, float("-inf")).scatter_(1, idx, row_table.gathered_rows_dot(x, w, idx))
        assert torch.equal(head(x, argmax_only=True), expected)


@pytest.mark.skipif(ops.load_extension() is None, reason="needs the fused CPU kernels")
def test_rescored_head_argmax_tokens_are_the_argmax_of_its_argmax_only_logits():
    """argmax_tokens (screened_argmax_out: no rows of -inf written) gives the token ops.argmax
    takes from the argmax-only logits, also where that scan's rules decide: candidates tied on
    the same logit (the lower token), token 0 among the candidates, a NaN logit, and a row whose
    candidates are all -inf (token 0, the first entry of a row of -inf)."""
    torch.manual_seed(6)
    w = torch.randn(4001, 128)
    w[1000] = w[3000] = w[7]  # identical rows: tied logits, always candidates together
    w[0] = w[7]  # and token 0 tied with them
    head = RescoredLMHead(Bf16Linear(w, None), w, screen=Q4Screen.from_float(w))
    for rows in (1, 5, 11):
        x = torch.randn(rows, 128)
        x[0] = w[7] * 3  # row 0: tokens 0, 7, 1000 and 3000 tie at the top
        expected = ops.argmax(head(x, argmax_only=True))
        got = head.argmax_tokens(x)
        assert got.dtype == torch.int64 and torch.equal(got, expected), rows
        assert got[0] == 0
    w_nan = w.clone()
    w_nan[7] = float("nan")  # tokens 7's logit NaN (and the screen's rank of it)
    head = RescoredLMHead(Bf16Linear(w_nan, None), w_nan, screen=Q4Screen.from_float(w))
    x = torch.randn(4, 128)
    x[1] = float("-inf")  # every logit NaN or -inf
    assert torch.equal(head.argmax_tokens(x), ops.argmax(head(x, argmax_only=True)))
    # No screen: no tokens (the caller takes the logits).
    assert RescoredLMHead(Bf16Linear(w, None), w).argmax_tokens(x) is None


def test_rescored_head_reuses_its_argmax_only_logits_across_calls():
    """Argmax-only calls write into one buffer that grows with the row count (fresh pages
    of a large one cost a page fault each): every call's result is what a fresh head
    computes, in or out of inference mode."""
    torch.manual_seed(3)
    w = torch.randn(3000, 64)
    xs = [torch.randn(rows, 64) for rows in (7, 3, 12, 1)]
    head = RescoredLMHead(Bf16Linear(w, None), w, screen=Q4Screen.from_float(w))
    expected = [RescoredLMHead(Bf16Linear(w, None), w, screen=head.screen)(x, argmax_only=True) for x in xs]
    with torch.inference_mode():
        got = [head(x, argmax_only=True).clone() for x in xs]
    got.append(head(xs[0], argmax_only=True).clone())  # outside inference mode too
    for g, e in zip(got, expected + expected[:1]):
        assert torch.equal(g, e)
    assert head._kept_logits.shape[0] == 12


@pytest.mark.parametrize("fast", ["bf16", "q8"])
def test_rescored_head_transient_logits_reuse_one_buffer(fast):
    """Transient calls (the runner's: sampled rows read every logit within the step) write the
    fast head's logits into the head's kept buffer: the same values as a plain call, in the
    same memory from call to call; plain calls still return tensors of their own."""
    torch.manual_seed(4)
    w = torch.randn(3000, 64)
    make = (lambda: Bf16Linear(w, None)) if fast == "bf16" else (lambda: Q8Linear.from_float(w))
    head = RescoredLMHead(make(), w, top_k=8, screen=Q4Screen.from_float(w))
    reference = RescoredLMHead(make(), w, top_k=8)
    xs = [torch.randn(rows, 64) for rows in (5, 9, 2)]
    kernels = ops.load_extension() is not None  # (without them: fresh tensors, as before)
    pointers = set()
    for x in xs:
        expected = reference(x)
        got = head(x, transient=True)
        assert torch.equal(got, expected)
        pointers.add(got.data_ptr())
        # An argmax-only call shares the buffer; a plain call does not touch it.
        assert (head(x, argmax_only=True).data_ptr() == got.data_ptr()) == kernels
        plain = head(x)
        assert torch.equal(plain, expected) and plain.data_ptr() != got.data_ptr()
    if kernels:
        assert len(pointers) == 2  # grown once (5 -> 9 rows), then reused
        assert head._kept_logits.shape == (9, 3000)
    else:  # nothing kept for logits the fast head cannot write (only the screen's, for argmax-only)
        fresh = RescoredLMHead(make(), w, top_k=8)
        fresh(xs[0], transient=True)
        assert fresh._kept_logits is None


def test_int8_linear_takes_widths_not_a_multiple_of_16():
    """torch's int8 kernel reads inputs in steps of 16 (a 24-wide layer crashed it): padded."""
    from kvserve.quant.int8 import Int8Linear
    from kvserve.quant.registry import native_linear_args
    torch.manual_seed(0)
    w, x = torch.randn(8, 24), torch.randn(3, 24)
    layer = Int8Linear(w, None)
    assert torch.allclose(layer(x), x @ w.T, rtol=0.05, atol=0.15)
    assert native_linear_args(layer) is None  # (runs as a module, not in the native decoder)
