"""The fused CPU kernels (kvserve/csrc: norm_rope.cpp, kv_write.cpp, attention*.cpp, sampling.cpp)
against their plain-torch references.

Paged attention has its own file (test_attention.py runs every case on both paths); here are
the norm, rotary embedding, KV-cache write and gated activation kernels, plus the build.
"""
from __future__ import annotations


import pytest
import torch

from kvserve import ops
from kvserve.models.layers import RopeFrequencies, rope_cos_sin, rope_inv_freq

pytestmark = pytest.mark.skipif(ops.load_extension() is None, reason="fused kernels disabled")


def test_extension_builds():
    """CI has a compiler: the kernels must build there, not silently fall back."""
    assert ops.load_extension() is not None
    assert ops.enabled_for(torch.zeros(1)) and not ops.enabled_for(torch.zeros(1, dtype=torch.bfloat16))
    with ops.use_kernels(False):
        assert not ops.enabled_for(torch.zeros(1))


@pytest.mark.parametrize("offset", [0.0, 1.0], ids=["llama", "gemma"])
@pytest.mark.parametrize("shape", [(1, 576), (7, 640), (3, 5, 64), (0, 64)])
def test_rms_norm(offset, shape):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen) * 5
    w = torch.randn(shape[-1], generator=gen)
    got = ops.rms_norm(x, w, 1e-6, offset)
    want = ops.rms_norm_reference(x.double(), w.double(), 1e-6, offset).float()
    assert got.shape == x.shape
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 1, 256), (2, 2, 6)])
def test_rope_qk_in_place(qk_norm, heads):
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(1)
    t = 6
    qkv = torch.randn(t, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen) * 3
    positions = torch.tensor([0, 1, 17, 511, 4095, 100_000])
    cos, sin = rope_cos_sin(positions, rope_inv_freq(head_dim, 10_000.0, None, "cpu"), torch.float32)
    norms = (torch.randn(head_dim, generator=gen), torch.randn(head_dim, generator=gen)) if qk_norm else (None, None)
    got, want = qkv.clone(), qkv.clone()
    ops.rope_qk_(got, cos, sin, num_heads, num_kv_heads, head_dim, *norms, 1e-6, 1.0)
    with ops.use_kernels(False):
        ops.rope_qk_(want, cos, sin, num_heads, num_kv_heads, head_dim, *norms, 1e-6, 1.0)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    v_start = (num_heads + num_kv_heads) * head_dim
    assert torch.equal(got[:, v_start:], qkv[:, v_start:])  # values untouched


def test_rope_rows_from_the_kept_tables_match_the_plain_ones():
    """RopeFrequencies.cos_sin (rows of its kept tables) gives rope_cos_sin's tables."""
    freqs = RopeFrequencies(64, 10_000.0, {"rope_type": "linear", "factor": 2.0})
    positions = torch.tensor([0, 5, 511, 100_000])
    for dtype in (torch.float32, torch.bfloat16):
        got = freqs.cos_sin(positions, dtype)
        want = rope_cos_sin(positions, rope_inv_freq(64, 10_000.0, {"rope_type": "linear", "factor": 2.0}, "cpu"), dtype)
        assert all(g.dtype == dtype and torch.equal(g, w) for g, w in zip(got, want))


def test_rope_tables_grow_and_hold_the_plain_rows():
    """RopeFrequencies.tables: row p is rope_cos_sin's for position p, bit for bit (the fused
    decoder and the Python model read the same rows); the tables grow to cover a longer
    sequence and keep their earlier rows."""
    freqs = RopeFrequencies(64, 10_000.0, None)
    cos, sin = freqs.tables(10, "cpu")
    first = cos.shape[0]
    assert first >= 10 and freqs.tables(first, torch.device("cpu"))[0] is cos  # no regrowth within
    grown_cos, grown_sin = freqs.tables(first + 1, "cpu")
    assert grown_cos.shape[0] > first and torch.equal(grown_cos[:first], cos) and torch.equal(grown_sin[:first], sin)
    want = rope_cos_sin(torch.arange(grown_cos.shape[0]), rope_inv_freq(64, 10_000.0, None, "cpu"), torch.float32)
    assert torch.equal(grown_cos, want[0]) and torch.equal(grown_sin, want[1])
    positions = torch.tensor([3, 0, first + 1, 7])
    got = freqs.cos_sin(positions, torch.float32, num_positions=first + 2)
    assert all(torch.equal(g, w[positions]) for g, w in zip(got, want))


@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
def test_act_and_mul(activation):
    gen = torch.Generator().manual_seed(2)
    gate = torch.cat([torch.randn(3, 100, generator=gen) * 4, torch.linspace(-120, 120, 300).view(3, 100)], -1)
    x = torch.cat([gate, torch.randn(3, 200, generator=gen)], -1)
    got = ops.act_and_mul(x, activation)
    want = ops.act_and_mul_reference(x.double(), activation).float()
    assert got.shape == (3, 200)
    assert torch.allclose(got, want, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("d", [16, 64, 128, 256])  # int8: 64, 128 and 256 hold two, four and eight 32-dim scale groups a head
@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16", "float16", "int8"])
def test_write_kv_cache_strided_inputs(cache_dtype, d):
    """k/v arrive as strided views of the qkv projection; slots are arbitrary. The kernel
    writes (and for int8, quantizes: the Hadamard rotation's butterflies in vectors, strides
    below 16 inside one) exactly what the torch reference does."""
    from kvserve.kv_cache import KVCache, KVCacheSpec

    gen = torch.Generator().manual_seed(3)
    kvh, t = 3, 6
    qkv = torch.randn(t, (2 + 2 * kvh) * d, generator=gen) * 3
    qkv[5] = 0  # an all-zero head vector: scale 0, values 0
    qkv[4, 2 * d] = 1e4  # an outlier: the rest of its head rounds to few levels
    k = qkv[:, 2 * d:(2 + kvh) * d].view(t, kvh, d)
    v = qkv[:, (2 + kvh) * d:].view(t, kvh, d)
    slots = torch.tensor([13, 0, 7, 22, 3, 9])
    spec = KVCacheSpec(1, kvh, d, 4, cache_dtype)
    got, want = KVCache.allocate(spec, 6, "cpu")[0], KVCache.allocate(spec, 6, "cpu")[0]
    got.write(k, v, slots)
    with ops.use_kernels(False):
        want.write(k, v, slots)
    assert torch.equal(got.data, want.data)
    if cache_dtype == "int8":
        assert torch.equal(got.scales, want.scales)
        assert got.data.abs().max() == 127 and not got.scales[:, :, 9 // 4, :, 9 % 4].any()
    ids = torch.arange(6)
    for stored, x in ((got.gather_keys(ids, torch.float32), k), (got.gather_values(ids, torch.float32), v)):
        stored = stored.transpose(0, 1)[slots]  # [t, KVH, D]
        if cache_dtype == "int8":
            # Rounded in the rotated basis (half a step of max|Hx| / 127 per dim); H is
            # orthonormal, so the error's norm is at most sqrt(D) / 254 of the head's norm.
            bound = d ** 0.5 / 254 * x.norm(dim=-1) + 1e-6
            assert ((stored - x).norm(dim=-1) <= bound).all()
        else:
            tolerance = {"float32": 0, "bfloat16": 2e-2, "float16": 2e-3}[cache_dtype]
            assert ((stored - x).abs() <= tolerance * x.abs().amax(-1, keepdim=True) + 1e-6).all()


def test_models_route_through_the_kernels(monkeypatch):
    """A tiny model's prefill + decode call every fused op (fp32, CPU) and match the torch path."""
    from kvserve.attention import build_attention_metadata
    from kvserve.kv_cache import allocate_kv_cache
    from kvserve.models.testing import build_random_model, tiny_config

    def prefill_then_decode(model, cfg):
        caches = allocate_kv_cache(cfg, 4, 16, torch.float32, "cpu")
        ids = torch.randint(0, cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(4))
        first = model.model(ids[:11], torch.arange(11), build_attention_metadata([[2, 0]], [0], [11], 16), caches)
        second = model.model(ids[11:], torch.tensor([11]), build_attention_metadata([[2, 0]], [11], [1], 16), caches)
        return torch.cat([first, second])

    fused_ops = ("rms_norm", "rope_qk_", "write_kv_cache", "act_and_mul", "paged_attention")
    for arch in ("llama", "gemma3"):
        cfg = tiny_config(arch)
        model = build_random_model(cfg)
        calls = []
        for name in fused_ops:
            kernel = getattr(ops._ext, name)
            monkeypatch.setattr(ops._ext, name, lambda *a, _k=kernel, _n=name: calls.append(_n) or _k(*a))
        fused = prefill_then_decode(model, cfg)
        monkeypatch.undo()
        assert set(fused_ops) <= set(calls), arch
        with ops.use_kernels(False):
            plain = prefill_then_decode(model, cfg)
        assert (fused - plain).abs().max() < 1e-4, arch


@pytest.mark.parametrize("block_size,cache_dtype,head_dim,heads_per_kv", [
    *[(bs, dtype, 32, 3) for bs in (8, 16, 32) for dtype in (torch.float32, torch.bfloat16, torch.int8)],
    (16, torch.int8, 128, 3),  # two int8 scale groups per head
    # a decode's row block holds 1, 2 or 4 query heads (the VNNI loops run only those rows)
    (16, torch.int8, 32, 1), (16, torch.int8, 32, 2), (16, torch.int8, 32, 4),
    (20, torch.bfloat16, 32, 3), (24, torch.bfloat16, 32, 3),  # blocks that end inside a 16-key chunk
])
def test_paged_attention_kernel_matches_torch_path(block_size, cache_dtype, head_dim, heads_per_kv):
    """Block sizes below, at and above the kernel's 16-key chunk (and, as the op takes any,
    ones not a multiple of it: more chunks per partition); a mixed step (decodes,
    a first chunk and chunks with cached context, some spanning the kernel's 128-key
    partitions) on shuffled blocks, GQA, with and without a sliding window; both paths read
    the same cache."""
    from kvserve.attention import build_attention_metadata, paged_attention
    from kvserve.kv_cache import KVCache, KVCacheSpec, LayerKV

    gen = torch.Generator().manual_seed(block_size)
    kv_heads = 2
    heads = kv_heads * heads_per_kv
    context, new = [0, 37, 80, 5, 150, 0, 300], [23, 1, 1, 40, 30, 140, 1]
    need = [-(-(c + n) // block_size) for c, n in zip(context, new)]
    order = torch.randperm(sum(need) + 2, generator=gen).tolist()
    tables = [order[sum(need[:i]):sum(need[:i + 1])] for i in range(len(need))]
    spec = KVCacheSpec(1, kv_heads, head_dim, block_size, cache_dtype)
    cache = KVCache.allocate(spec, sum(need) + 2, "cpu")[0]
    cache.data.copy_(torch.randn(cache.data.shape, generator=gen) * (40 if cache_dtype == torch.int8 else 1))
    old = build_attention_metadata(tables, [0] * len(context), context, block_size)
    if sum(context):
        cache.write(torch.randn(sum(context), kv_heads, head_dim, generator=gen),
                    torch.randn(sum(context), kv_heads, head_dim, generator=gen), old.slot_mapping)
    clone = lambda: LayerKV(cache.data.clone(), None if cache.scales is None else cache.scales.clone())  # noqa: E731
    compute_dtype = cache.compute_dtype(torch.float32)
    q = torch.randn(sum(new), heads, head_dim, generator=gen)
    k = torch.randn(sum(new), kv_heads, head_dim, generator=gen)
    v = torch.randn(sum(new), kv_heads, head_dim, generator=gen)
    for window in (None, 19):
        md = build_attention_metadata(tables, context, new, block_size)
        fused = paged_attention(q, k, v, clone(), md, head_dim ** -0.5, window)
        with ops.use_kernels(False):
            md = build_attention_metadata(tables, context, new, block_size)
            plain = paged_attention(q.to(compute_dtype), k.to(compute_dtype), v.to(compute_dtype), clone(), md,
                                    head_dim ** -0.5, window).float()
        # The torch path rounds q and the probabilities to a bf16 cache's dtype; the kernel
        # keeps them in fp32: the bound is bf16's rounding, or fp32 noise for an fp32 cache.
        # Over int8 the kernel rounds q and the weights to int16 (1/65534 of their range).
        bound = {torch.bfloat16: 2e-2, torch.int8: 2e-4}.get(cache_dtype, 1e-5)
        if cache_dtype == torch.int8:
            # The portable loops (CPUs without AVX512-VNNI) sum the same integers: same bits.
            ops._ext.set_portable_int8_attention(True)
            try:
                portable = paged_attention(q, k, v, clone(), build_attention_metadata(tables, context, new, block_size),
                                           head_dim ** -0.5, window)
            finally:
                ops._ext.set_portable_int8_attention(False)
            assert torch.equal(portable, fused)
        assert (fused - plain).abs().max() < bound, window


def test_top_k_and_argmax_match_torch():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 49_152, generator=gen)
    x[1, 1000:1010] = 50.0  # ties: the lower index first, as argmax picks
    x[2] = 0.0
    for k in (1, 2, 16, 64):
        values, indices = ops.top_k(x, k)
        ref_values, _ = x.topk(k, dim=-1)
        assert torch.equal(values, ref_values)
        assert torch.equal(x.gather(1, indices), values)
    assert torch.equal(ops.argmax(x), x.argmax(-1))
    assert ops.top_k(x, 5)[1][1].tolist() == [1000, 1001, 1002, 1003, 1004]
    assert torch.equal(ops.top_k(x[:, :7], 7)[0], x[:, :7].topk(7, dim=-1)[0])


def _ranked(row: torch.Tensor, k: int) -> list[int]:
    """The k best indices of a row, ties to the lower index (the kernels' order), in Python."""
    return sorted(range(row.numel()), key=lambda j: (-row[j].item(), j))[:k]


@pytest.mark.parametrize("vocab", [49_152, 3_000])  # the strided sample's threshold; the histogram alone
def test_top_k_of_many_candidates_matches_torch(vocab):
    """k > 64 (the sampler's 1,024 top-p candidates) takes the selecting kernel: torch's values,
    sorted, ties to the lower index as top_k_rows, -inf and repeated values included."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(5, vocab, generator=gen) * 3
    x[0, :100] = float("-inf")
    x[1, 200:2000] = 1.25  # a tie across the k-th place
    x[2] = torch.randint(0, 4, (vocab,), generator=gen).float()  # ties everywhere
    x[3, ::4] += 20.0  # what the strided sample sees stands above nearly every other entry
    x[4, 7] = float("inf") - float("inf")  # a NaN with the sign bit set (x86's default): first, as torch
    x[4, 300:310] = -0.0
    x[4, 305:320] = 0.0
    for k in (65, 1024, vocab):
        values, indices = ops.top_k(x, k)
        assert torch.equal(values[:4], x[:4].topk(k, dim=-1).values), k
        assert torch.equal(x.gather(1, indices)[:4], values[:4])
        assert indices[4, 0] == 7 and values[4, 0].isnan()
        rest = x[4].clone()
        rest[7] = float("-inf")
        assert torch.equal(values[4, 1:], rest.topk(k - 1).values)
        if k == 1024:
            for r in (1, 2):
                assert indices[r].tolist() == _ranked(x[r], k)
    # +0.0 and -0.0 are one value: the lower index first, as top_k_rows.
    z = torch.full((1, vocab), -1.0)
    z[0, 100:120] = -0.0
    z[0, 110:130] = 0.0
    assert ops.top_k(z, 65)[1][0, :30].tolist() == list(range(100, 130))
    assert ops.top_k(z, 30)[1][0].tolist() == list(range(100, 130))


@pytest.mark.parametrize("vocab", [49_152, 1_000, 37])  # whole words, a ragged last word, < 2 words
def test_apply_token_bitmask_matches_reference(vocab):
    """Grammar masks: bit t % 32 of int32 word t / 32 allows token t (sign bit included);
    only the listed rows change, tokens past the bitmask are forbidden."""
    import numpy as np

    rng = np.random.default_rng(vocab)
    x = torch.from_numpy(rng.standard_normal((5, vocab)).astype(np.float32))
    words = (vocab + 31) // 32
    bitmask = rng.integers(-2**31, 2**31, size=(3, words), dtype=np.int64).astype(np.int32)
    bitmask[0] = 0
    bitmask[0, -1] = -1  # only the last word's tokens
    bitmask[1] = -1  # everything
    rows = [4, 0, 2]
    got = ops.apply_token_bitmask(x, rows, bitmask)
    want = ops.apply_token_bitmask_reference(x, rows, bitmask)
    assert torch.equal(got, want) and got.data_ptr() != x.data_ptr()
    assert torch.equal(got[[1, 3]], x[[1, 3]]) and torch.equal(got[0], x[0])
    assert torch.isinf(got[4, :32 * (words - 1)]).all() and torch.equal(got[4, 32 * (words - 1):], x[4, 32 * (words - 1):])
    bit = lambda t: bool((int(bitmask[2, t // 32]) >> (t % 32)) & 1)
    assert [bool(torch.isfinite(got[2, t])) for t in range(vocab)] == [bit(t) for t in range(vocab)]
    # A bitmask narrower than the logits (a padded LM head): the extra columns are forbidden.
    wide = torch.cat([x, x[:, :40]], dim=1)
    got_wide = ops.apply_token_bitmask(wide, rows, bitmask)
    assert torch.equal(got_wide, ops.apply_token_bitmask_reference(wide, rows, bitmask))
    assert torch.isinf(got_wide[:, 32 * words:][[4, 0, 2]]).all()
