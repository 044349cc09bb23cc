"""A GGUF model on the file's own blocks (kvserve.loader.gguf_blocks), and the synthetic
real-shape files (kvserve.loader.synthetic): rows read in place equal gguf's dequantization for
every type; the native repacking equals the numpy unpacking byte for byte; the model built
without a float copy computes what the float-then-convert path computes, step for step; the
engine takes the file's format by default."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGML_QUANT_SIZES
from gguf.quants import dequantize

from kvserve import LLM, SamplingParams, ops
from kvserve.engine import resolve_precision
from kvserve.loader import load_model, source_has_blocks
from kvserve.loader.gguf import config_from_gguf, open_gguf
from kvserve.loader.gguf_blocks import build_gguf_model
from kvserve.loader.resolve import resolve_model
from kvserve.loader.synthetic import SHAPES, parse_spec, random_blocks, synthetic_path
from kvserve.quant import Int4Linear, Q8Linear
from kvserve.row_table import GGUFRows
from kvserve.quant.lm_head import RescoredLMHead

needs_kernels = pytest.mark.skipif(ops.load_extension() is None, reason="the fused CPU kernels are not built")
ROW_TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K]


def _raw(qtype: T, n: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if qtype == T.F32:
        return rng.normal(0, 1, (n, k)).astype(np.float32).view(np.uint8)
    if qtype == T.F16:
        return rng.normal(0, 1, (n, k)).astype(np.float16).view(np.uint8)
    if qtype == T.BF16:
        return (rng.normal(0, 1, (n, k)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    return random_blocks(qtype, (n, k), rng)


@needs_kernels
@pytest.mark.parametrize("qtype", ROW_TYPES, ids=lambda t: t.name)
def test_rows_in_place_equal_gguf_dequantize(qtype):
    n, k = 40, 512
    raw = _raw(qtype, n, k)
    table = GGUFRows(torch.from_numpy(raw), int(qtype), k)
    ids = torch.tensor([0, 7, 39, 7, 12])
    expected = dequantize(raw, qtype).reshape(n, k)[ids.numpy()]
    native = table(ids)
    assert native.dtype == torch.float32 and native.shape == (5, k)
    assert np.array_equal(native.numpy().view(np.uint32), expected.astype(np.float32).view(np.uint32))
    # the exact rows of the LM head's rescoring: the same values through the gathered-rows kernel
    x = torch.randn(2, k)
    idx = torch.tensor([[3, 9], [39, 0]])
    from kvserve.row_table import gathered_rows_dot, gathered_rows_dot_reference
    assert torch.allclose(gathered_rows_dot(x, table, idx), gathered_rows_dot_reference(x, table, idx), rtol=1e-5,
                          atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q4_0, T.Q8_0, T.Q6_K], ids=lambda t: t.name)
def test_repacking_row_stacked_parts_equals_repacking_their_concatenation(qtype):
    # A fused projection's q, k and v are repacked where the file holds them, not copied together
    # first; part sizes off the 16-row tiles, so a tile spans two parts.
    from kvserve.quant import Q5KLinear, Q6KLinear
    from kvserve.quant.registry import gguf_format
    k, sizes = 512, (21, 5, 14)
    parts = [_raw(qtype, n, k, seed=i) for i, n in enumerate(sizes)]
    shape = (sum(sizes), k)
    build = gguf_format(qtype.name).from_gguf_raw
    whole, split = build(np.concatenate(parts), qtype.name, shape, None), build(parts, qtype.name, shape, None)
    if whole is None:
        pytest.skip("this CPU's kernel for the type reads rows, not a repacked layout")
    assert type(whole) is type(split) and isinstance(whole, (Int4Linear, Q5KLinear, Q6KLinear, Q8Linear))
    for (name, a), (_, b) in zip(whole.named_buffers(), split.named_buffers()):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), name


@needs_kernels
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q4_1, T.Q4_0, T.Q8_0, T.Q6_K], ids=lambda t: t.name)
def test_native_repacking_equals_numpy_unpacking(qtype):
    n, k = 37, 512
    raw = _raw(qtype, n, k, seed=3)
    cls = Int4Linear if qtype in (T.Q4_K, T.Q4_1, T.Q4_0) else Q8Linear
    native = cls.from_gguf_raw(raw, qtype.name, (n, k), None)
    if native is None:
        pytest.skip("this CPU's nibble kernel reads rows, not tiles")
    from kvserve import block_formats
    blocks = block_formats.unpack(qtype.name, raw, (n, k))
    reference = Int4Linear.from_nibble_blocks(blocks, None) if cls is Int4Linear else Q8Linear.from_byte_blocks(
        blocks, None)
    if qtype == T.Q4_K:  # in its own bits: 4.625 per weight, against 6 for the fp32-scale tiles
        assert native.packed.numel() * 8 / (n * k) < 4.7 + 16 * 8 * 4.7 / n
    else:  # the same buffers
        for name, buffer in reference.named_buffers():
            other = getattr(native, name)
            assert (buffer is None) == (other is None), name
            if buffer is not None:
                assert buffer.dtype == other.dtype and torch.equal(buffer, other), name
    assert torch.equal(native.dequantized(), reference.dequantized())
    for rows in (1, 3, 8):  # the same outputs, bit for bit, for any number of rows
        x = torch.randn(rows, k)
        assert torch.equal(native(x), reference(x))


def test_synthetic_specs():
    assert parse_spec("smollm2-135m-instruct") is None
    shape, fmt = parse_spec("synthetic:llama-1b:q4_k_m")
    assert (shape.layers, shape.hidden, shape.ffn, shape.heads, shape.kv_heads, fmt) == (16, 2048, 8192, 32, 8, "Q4_K_M")
    from kvserve.config import ConfigError
    with pytest.raises(ConfigError, match="unknown synthetic shape"):
        parse_spec("synthetic:llama-70b:Q4_K_M")
    with pytest.raises(ConfigError, match="unknown synthetic format"):
        parse_spec("synthetic:llama-1b:Q3_K_S")


@pytest.fixture(scope="module")
def tiny_q4_k_m(tmp_path_factory):
    """A two-layer llama file in llama.cpp's Q4_K_M mix (random blocks; no llama.cpp needed)."""
    root = tmp_path_factory.mktemp("synthetic")
    tokenizer = resolve_model("smollm2-135m-instruct").path
    from pathlib import Path
    return str(synthetic_path(SHAPES["tiny"], "Q4_K_M", Path(tokenizer), cache_dir=root, use_llama_cpp=False))


def test_synthetic_file_has_the_shape_and_mix(tiny_q4_k_m):
    gf = open_gguf(tiny_q4_k_m)
    types = {name: info.quant_type for name, info in gf.tensors.items()}
    assert types["token_embd.weight"] == T.Q6_K  # tied: the output's type
    assert types["blk.0.attn_q.weight"] == T.Q4_K and types["blk.1.ffn_down.weight"] == T.Q6_K
    assert gf.tensors["blk.0.ffn_gate.weight"].shape == (512, 256)
    assert source_has_blocks(resolve_model(tiny_q4_k_m))


@needs_kernels
def test_model_on_blocks_computes_what_the_converted_model_does(tiny_q4_k_m):
    """The model built on the blocks (no float copy) and the old path (float model, then its
    linear layers read on the same blocks) hold the same values in the same formats: their logits
    agree bit for bit, through the native decoder."""
    source = resolve_model(tiny_q4_k_m)
    model, config = load_model(source, quantization="gguf")
    assert isinstance(model.model.embed_tokens, GGUFRows) and isinstance(model.lm_head, RescoredLMHead)
    assert all(p.device.type == "cpu" for p in model.parameters())
    converted, _ = load_model(source, quantization="int4", int4_prefill="blocks")
    ids = torch.tensor([1, 5, 100, 3000])
    assert torch.equal(model.model.embed_tokens(ids), converted.model.embed_tokens(ids) if not isinstance(
        converted.model.embed_tokens, torch.nn.Embedding) else converted.model.embed_tokens.weight[ids])
    # The head reads the file's Q6_K blocks (the old path requantized it to Q8_0): against the
    # dequantized table in fp32.
    hidden = torch.randn(3, config.hidden_size)
    table = model.model.embed_tokens.dequantized()
    assert torch.allclose(model.lm_head(hidden), hidden @ table.T, rtol=1e-4, atol=1e-4)
    for name, module in model.named_modules():
        if isinstance(module, (Int4Linear, Q8Linear)) and not name.startswith("lm_head"):
            other = converted.get_submodule(name)
            x = torch.randn(2, module.in_features)
            assert torch.equal(module(x), other(x)), name


@needs_kernels
def test_engine_reads_the_file_format_by_default(tiny_q4_k_m):
    assert resolve_precision("auto", None, torch.device("cpu"), stored_blocks=True) == (torch.float32, "gguf")
    assert resolve_precision("auto", "none", torch.device("cpu"), stored_blocks=True)[1] != "gguf"
    prompts = ["The capital of France is", "One, two, three,"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    blocks = LLM(tiny_q4_k_m, max_model_len=256, kv_cache_memory=32 << 20)
    assert blocks.engine.weight_format == "gguf"
    got = [o.outputs[0].token_ids for o in blocks.generate(prompts, params)]
    converted = LLM(tiny_q4_k_m, quantization="int4", int4_prefill="blocks", max_model_len=256,
                    kv_cache_memory=32 << 20)
    assert got == [o.outputs[0].token_ids for o in converted.generate(prompts, params)]
    # batch of one: the same tokens (batch invariance holds on the blocks)
    assert [blocks.generate([p], params)[0].outputs[0].token_ids for p in prompts] == got


def test_rows_read_in_place_go_back_to_the_file_every_few_steps(tiny_q4_k_m):
    # The runner hands the mapped tables' pages back (GGUFRows.release_pages) so rows read once
    # do not stay resident; reading them again after that gives the same tokens.
    from kvserve.row_table import MAPPED_ROWS_RELEASE_STEPS

    llm = LLM(tiny_q4_k_m, max_model_len=256, kv_cache_memory=32 << 20)
    runner = llm.engine.executor.runner
    assert runner.mapped_tables and all(isinstance(t, GGUFRows) for t in runner.mapped_tables)
    released = []
    for table in runner.mapped_tables:
        table.release = (lambda inner: lambda: (released.append(1), inner()))(table.release)
    params = SamplingParams(max_tokens=3 * MAPPED_ROWS_RELEASE_STEPS, temperature=0.0, ignore_eos=True)
    first = llm.generate(["One, two, three,"], params)[0].outputs[0].token_ids
    assert len(released) >= 2 * len(runner.mapped_tables)
    assert llm.generate(["One, two, three,"], params)[0].outputs[0].token_ids == first


@needs_kernels
def test_real_models_on_their_blocks_match_the_converted_path():
    """SmolLM2 (Q4_1 layers, Q8_0 embedding) on its blocks: the same greedy tokens as the int4
    mode on the same blocks."""
    source = resolve_model("smollm2-135m-instruct")
    gf = open_gguf(source.path)
    model, counts = build_gguf_model(gf, config_from_gguf(gf))
    assert any("Q4_1" in kind for kind in counts)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    a = LLM("smollm2-135m-instruct", quantization="gguf", max_model_len=512, kv_cache_memory=64 << 20)
    b = LLM("smollm2-135m-instruct", quantization="int4", int4_prefill="blocks", max_model_len=512,
            kv_cache_memory=64 << 20)
    prompt = ["Write a haiku about the sea."]
    assert a.generate(prompt, params)[0].outputs[0].token_ids == b.generate(prompt, params)[0].outputs[0].token_ids


@needs_kernels
@pytest.mark.parametrize("k", [256, 768])
def test_q6_k_in_its_own_bits(k):
    """Q6_K's own tiles: the file's values exactly, 6.5625 bits a weight, the kernel within fp32
    rounding of x @ W^T and the same bits for any number of rows; the portable loop too."""
    from kvserve.quant import Q6KLinear
    n = 37
    raw = _raw(T.Q6_K, n, k, seed=5)
    layer = Q6KLinear.from_gguf_raw(raw, "Q6_K", (n, k), torch.randn(n))
    if layer is None:
        pytest.skip("this CPU's kernels keep Q6_K as 8-bit codes (no AVX512-VNNI)")
    assert layer.packed.numel() == -(-n // 16) * 16 * k * 6.5625 / 8
    w = torch.from_numpy(dequantize(raw, T.Q6_K).reshape(n, k).astype(np.float32))
    assert torch.equal(layer.dequantized(), w)
    x = torch.randn(9, k)
    reference = x @ w.T + layer.bias
    full = layer(x)
    assert torch.allclose(full, reference, rtol=1e-3, atol=1e-3 * float(reference.abs().max()))
    for rows in (1, 3, 4, 5):
        assert torch.equal(layer(x[:rows]), full[:rows])
    ext = ops.load_extension()
    ext.set_portable_quant_kernels(True)
    try:
        portable = layer(x)
    finally:
        ext.set_portable_quant_kernels(False)
    assert torch.allclose(portable, reference, rtol=1e-2, atol=1e-2 * float(reference.abs().max()))


@needs_kernels
@pytest.mark.parametrize("fmt", ["Q4_0", "Q8_0", "Q6_K"])
def test_other_file_types_are_held_in_their_own_formats(fmt, tmp_path):
    """A Q4_0, Q8_0 or Q6_K file: every projection on its blocks (none in bf16), each layer's
    weights the file's values exactly."""
    from pathlib import Path
    tokenizer = Path(resolve_model("smollm2-135m-instruct").path)
    path = synthetic_path(SHAPES["tiny"], fmt, tokenizer, cache_dir=tmp_path, use_llama_cpp=False)
    gf = open_gguf(str(path))
    model, counts = build_gguf_model(gf, config_from_gguf(gf))
    assert not any("bf16" in kind for kind in counts), counts
    info = gf.tensors["blk.0.ffn_down.weight"]
    expected = dequantize(gf.raw("blk.0.ffn_down.weight"), info.quant_type).reshape(info.shape)
    assert torch.equal(model.model.layers[0].mlp.down_proj.dequantized(), torch.from_numpy(expected))


@needs_kernels
def test_q5_k_in_its_own_bits():
    """Q5_K read as stored (5.625 bits per weight; it was held in bf16): gguf's values, and the
    kernels' outputs against them."""
    from kvserve.quant import Q5KLinear
    n, k = 37, 512
    raw = _raw(T.Q5_K, n, k, seed=5)
    layer = Q5KLinear.from_gguf_raw(raw, "Q5_K", (n, k), torch.randn(n))
    if layer is None:
        pytest.skip("this CPU's nibble kernel reads rows, not tiles")
    assert layer.packed.numel() * 8 / (n * k) < 5.7 + 16 * 8 * 5.7 / n
    w = torch.from_numpy(dequantize(raw, T.Q5_K).reshape(n, k))
    assert torch.equal(layer.dequantized(), w)
    for rows in (1, 3, 8):
        x = torch.randn(rows, k)
        exact = x.double() @ w.double().T + layer.bias.double()
        assert (layer(x).double() - exact).norm() / exact.norm() < 1e-4


def test_mapped_rows_copy_without_their_release_hook(tiny_q4_k_m):
    import copy

    model, _ = load_model(resolve_model(tiny_q4_k_m), dtype=torch.float32, quantization="gguf")
    table = next(m for m in model.modules() if isinstance(m, GGUFRows))
    assert table.release is not None  # (it holds the file's mapping, which does not copy)
    clone = copy.deepcopy(table)
    ids = torch.tensor([1, 5, 9])
    assert clone.release is None and torch.equal(clone(ids), table(ids))
