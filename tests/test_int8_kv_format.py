"""The int8 KV cache's format (issue 64: one fp16 scale per token, KV head and 32 rotated dims)
against an independent model of it, and its attention's batch invariance on 64-dim heads (two
scale groups a head, SmolLM2's shape). The write kernel against quantize_int8 bit for bit, and
the attention kernel against attention over the dequantized cache: tests/test_ops.py,
tests/test_attention.py."""
from __future__ import annotations

import pytest
import torch

from kvserve import ops
from kvserve.attention import build_attention_metadata, paged_attention
from kvserve.kv_cache import INT8_MAX, KVCache, KVCacheSpec, dequantize_int8, quantize_int8


def sylvester_hadamard(d: int) -> torch.Tensor:
    """The normalised Walsh-Hadamard matrix of order d, in float64, by Sylvester's construction."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / d ** 0.5


@pytest.mark.parametrize("d", [32, 64, 256])
def test_quantize_int8_is_per_32_rotated_dims(d):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, d, generator=gen, dtype=torch.float64)
    x[..., 5] *= 40  # an outlier channel, as real keys have: the rotation spreads it over the head
    values, scales = quantize_int8(x.float())
    assert values.dtype == torch.int8 and scales.dtype == torch.float16 and scales.shape == (50, 3, d // 32)
    rotated = (x @ sylvester_hadamard(d)).unflatten(-1, (d // 32, 32))  # H is symmetric
    want_scales = rotated.abs().amax(-1) / INT8_MAX
    # fp16 scales of the group maxima (fp32 butterflies against a float64 matrix: a few ulps).
    torch.testing.assert_close(scales.double(), want_scales.half().double(), rtol=2e-3, atol=0)
    codes = rotated / scales.double()[..., None]
    assert ((values.double().unflatten(-1, (d // 32, 32)) - codes).abs() <= 0.5 + 1e-3).all()
    # Back in the original basis, each group's error is at most half a step per dim of it.
    error = (dequantize_int8(values, scales).double() @ sylvester_hadamard(d) - rotated.flatten(-2)).unflatten(
        -1, (d // 32, 32))
    assert (error.abs() <= scales.double()[..., None] / 2 + 1e-6).all()


def test_int8_scales_are_per_token_so_a_block_never_changes_after_its_write():
    """Prefix caching shares full blocks: what a token's write stores (codes and scales) must
    not depend on what is written after it in the same block."""
    spec = KVCacheSpec(1, 2, 64, 16, "int8")
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(16, 2, 64, generator=gen), torch.randn(16, 2, 64, generator=gen)
    one_step, token_by_token = KVCache.allocate(spec, 1, "cpu")[0], KVCache.allocate(spec, 1, "cpu")[0]
    one_step.write(k, v, torch.arange(16))
    for t in range(16):
        token_by_token.write(k[t:t + 1], v[t:t + 1], torch.tensor([t]))
    assert torch.equal(one_step.data, token_by_token.data) and torch.equal(one_step.scales, token_by_token.scales)


@pytest.mark.parametrize("kernels", [True, False], ids=["kernel", "torch"])
def test_int8_attention_rows_do_not_depend_on_the_batch(kernels):
    """A sequence's outputs (a decode row and a prefill chunk, 64-dim heads: two scale groups)
    are bit-identical alone and batched with others."""
    if kernels and ops.load_extension() is None:
        pytest.skip("fused CPU kernels not built")
    heads, kv_heads, d, block = 6, 2, 64, 16
    spec = KVCacheSpec(1, kv_heads, d, block, "int8")
    gen = torch.Generator().manual_seed(2)
    contexts, queries = [300, 70, 5], [1, 9, 1]
    tables = [list(range(0, 20)), list(range(20, 26)), list(range(26, 28))]
    kv = KVCache.allocate(spec, 28, "cpu")[0]
    cached = build_attention_metadata(tables, [0] * 3, contexts, block)
    kv.write(torch.randn(sum(contexts), kv_heads, d, generator=gen), torch.randn(sum(contexts), kv_heads, d, generator=gen),
             cached.slot_mapping)
    q = [torch.randn(n, heads, d, generator=gen) for n in queries]
    k = [torch.randn(n, kv_heads, d, generator=gen) for n in queries]
    v = [torch.randn(n, kv_heads, d, generator=gen) for n in queries]

    def attend(seqs: list[int]) -> list[torch.Tensor]:
        layer = KVCache.allocate(spec, 28, "cpu")[0]
        layer.data.copy_(kv.data), layer.scales.copy_(kv.scales)
        md = build_attention_metadata([tables[s] for s in seqs], [contexts[s] for s in seqs],
                                      [queries[s] for s in seqs], block)
        with ops.use_kernels(kernels):
            out = paged_attention(torch.cat([q[s] for s in seqs]), torch.cat([k[s] for s in seqs]),
                                  torch.cat([v[s] for s in seqs]), layer, md, d ** -0.5, None)
        return list(out.split([queries[s] for s in seqs]))

    batched = attend([0, 1, 2])
    for s in range(3):
        assert torch.equal(attend([s])[0], batched[s])
