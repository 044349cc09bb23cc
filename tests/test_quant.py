"""Unit tests of the weight formats: exact Q4_1 repacking, int4/int8 kernels, LM-head rescoring."""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from kvserve.quant import Bf16Linear, Int4Linear, Int8Linear, RescoredLMHead, unpack_q4_1


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
    q, d, m = unpack_q4_1(raw, (8, 64))
    ours = (q.view(8, 2, 32).float() * d[..., None] + m[..., None]).view(8, 64)
    ref = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_1)).view(8, 64)
    assert torch.equal(ours, ref.float())


def test_int4_from_q4_1_matches_fp32_linear():
    n, k = 96, 128
    raw = _random_q4_1(n, k, seed=1)
    q, d, m = unpack_q4_1(raw, (n, k))
    layer = Int4Linear(q, d, m + 8.0 * d, None)
    w = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_1)).view(n, k).float()
    x = torch.randn(5, k)
    rel = (layer(x) - x @ w.T).norm() / (x @ w.T).norm()
    assert layer(x).dtype == torch.float32
    assert rel < 5e-3  # bf16 activations and scales; the 4-bit values themselves are exact


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
