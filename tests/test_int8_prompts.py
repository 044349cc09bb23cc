"""The int8 prompt path of the tile kernels (csrc/quant_linear.cpp's PromptActivations,
``--int4-prefill int8`` on a GGUF read on its blocks): each kernel equals a numpy model of its
rounding (bytes per half-group of 16 inputs, split 16-bit integers for the groups holding a
"massive" input) times the dequantized weights, within fp32 rounding, for every row blocking and
traversal; a row's bits do not depend on the other rows; an engine on that path keeps greedy
output invariant under batching, chunked prefill and prefix-cache hits."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from kvserve import LLM, SamplingParams, ops
from kvserve.block_formats import QuantizedTensor
from kvserve.loader import load_model
from kvserve.loader.resolve import resolve_model
from kvserve.quant import Int4Linear, Q5KLinear, Q6KLinear, gguf_linear, int8_prompt_layers
from kvserve.token_roles import ALL_PROMPT, TokenRoles, use_token_roles

from test_block_formats import random_blocks
from test_gguf_blocks import tiny_q4_k_m  # noqa: F401 (the fixture)

pytestmark = pytest.mark.skipif(not ops.int8_prompt_kernels(), reason="the int8 prompt kernels need AVX512-VNNI")

WIDE_HALF = 4.0  # csrc/quant_linear.cpp's kWideHalf
LEVELS, WIDE_LEVELS = 127.0, 32639.0


def prompt_activations(x: torch.Tensor) -> torch.Tensor:
    """The values the kernel multiplies: per row and half-group of 16, round(x * L / a) * a / L in
    fp32 steps, L = 127, or 32639 for a group of 32 whose half's largest |x| exceeds 4x the row's RMS."""
    m, k = x.shape
    xs = x.numpy().astype(np.float32)
    rms = np.sqrt((xs.astype(np.float64) ** 2).mean(-1)).astype(np.float32)
    halves = xs.reshape(m, k // 16, 16)
    a = np.abs(halves).max(-1, keepdims=True)
    wide = (a.reshape(m, k // 32, 2).max(-1) > WIDE_HALF * rms[:, None]).repeat(2, axis=1)[:, :, None]
    levels = np.where(wide, np.float32(WIDE_LEVELS), np.float32(LEVELS)).astype(np.float32)
    inverse = np.where(a > 0, levels / np.where(a > 0, a, 1), 0).astype(np.float32)
    q = np.rint((halves * inverse).astype(np.float32))
    return torch.from_numpy((q * (a / levels).astype(np.float32)).reshape(m, k).astype(np.float64))


def _layer(qtype: T, n: int, k: int):
    data = random_blocks(qtype, n, k, seed=int(qtype))
    if qtype == T.Q6_K:
        return Q6KLinear.from_gguf_raw(data, "Q6_K", (n, k), None)
    if qtype in (T.Q4_K, T.Q4_1):
        return Int4Linear.from_gguf_raw(data, qtype.name, (n, k), None)
    if qtype == T.Q5_K:
        return Q5KLinear.from_gguf_raw(data, "Q5_K", (n, k), None)
    return gguf_linear([QuantizedTensor(qtype, data, (n, k))], None)


def _activations(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, 5] *= 30  # a massive channel in every row (its group goes wide)
    x[0, k // 2] = 50.0  # and one in a single row
    return x


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q4_1, T.Q5_0, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("m,n,k", [(1, 40, 512), (5, 40, 512), (8, 40, 512), (13, 40, 512), (70, 40, 4096)])
def test_kernel_equals_its_rounding_model(qtype, m, n, k):
    layer = _layer(qtype, n, k)
    assert layer.reads_int8_prompts()
    weights = layer.dequantized().double()
    x = _activations(m, k, seed=m)
    got = ops.load_extension().tiled_nibble_int8_linear(x, layer.packed, n, None).double()
    rounded = prompt_activations(x)
    expected = rounded @ weights.T
    magnitude = rounded.abs() @ weights.abs().T
    assert ((got - expected).abs() <= 1e-6 * magnitude + 1e-30).all()
    # ...and it is the int8 path: the exact activations give results farther off than that
    exact = x.double() @ weights.T
    assert ((exact - expected).abs() / magnitude).max() > 1e-4


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_a_rows_bits_do_not_depend_on_the_other_rows(qtype):
    layer = _layer(qtype, 40, 4096)
    ext = ops.load_extension()
    x = _activations(37, 4096, seed=1)
    together = ext.tiled_nibble_int8_linear(x, layer.packed, 40, None)
    for i in (0, 1, 8, 36):
        assert torch.equal(ext.tiled_nibble_int8_linear(x[i:i + 1], layer.packed, 40, None)[0], together[i])
    assert torch.equal(ext.tiled_nibble_int8_linear(x[3:20], layer.packed, 40, None), together[3:20])


def test_non_finite_input_stays_in_its_row():
    layer = _layer(T.Q4_K, 16, 512)
    x = _activations(3, 512, seed=2)
    x[1, 7] = float("nan")
    y = ops.load_extension().tiled_nibble_int8_linear(x, layer.packed, 16, None)
    assert not torch.isfinite(y[1]).any() and torch.isfinite(y[0]).all() and torch.isfinite(y[2]).all()


def test_model_takes_the_int8_path_only_when_asked(tiny_q4_k_m):  # noqa: F811
    source = resolve_model(tiny_q4_k_m)
    exact, _ = load_model(source, quantization="gguf")
    int8, config = load_model(source, quantization="gguf", int4_prefill="int8")
    assert int8_prompt_layers(exact) == 0
    # every decoder linear (a segmented qkv counts once), never the LM head
    assert int8_prompt_layers(int8) >= 4 * config.num_hidden_layers
    assert int8_prompt_layers(int8.lm_head) == 0
    x = torch.randn(6, config.hidden_size)
    layer = int8.model.layers[0].mlp.gate_up_proj
    with torch.inference_mode():
        generated = layer(x)
        with use_token_roles(TokenRoles(ALL_PROMPT)):
            prompt = layer(x)
    assert torch.equal(generated, exact.model.layers[0].mlp.gate_up_proj(x))
    assert torch.equal(prompt, layer.forward_int8_prompts(x)) and not torch.equal(prompt, generated)


def test_greedy_output_is_invariant_on_the_int8_path(tiny_q4_k_m):  # noqa: F811
    """Prompt rows int8, generated rows 16-bit: batching, chunking and prefix hits move no token."""
    prompts = ["The capital of France is", "One, two, three, four, five, six, seven, eight, nine, ten"]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    llm = LLM(tiny_q4_k_m, int4_prefill="int8", max_model_len=256, kv_cache_memory=32 << 20)
    assert llm.engine.int8_prompt_layers > 0 and llm.engine.prefill_copies
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts] == batched  # (prefix hits)
    chunked = LLM(tiny_q4_k_m, int4_prefill="int8", max_model_len=256, kv_cache_memory=32 << 20,
                  max_num_batched_tokens=8, enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in chunked.generate(prompts, params)] == batched
