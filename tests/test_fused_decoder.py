"""The native decoder-layer loop (kvserve/models/fused.py, csrc/decoder.cpp) against the
Python model it replaces: same kernels and ops, same order, so the same numbers, bit for bit,
in every weight format."""
from __future__ import annotations

import copy
from typing import Callable, Optional

import pytest
import torch

from kvserve import ops
from kvserve.attention import build_attention_metadata
from kvserve.kv_cache import allocate_kv_cache
from kvserve.loader import load_model, resolve_model
from kvserve.models.fused import attach_fused_layers
from kvserve.row_table import table_args
from kvserve.token_roles import ALL_GENERATED, ALL_PROMPT, MIXED, TokenRoles, use_token_roles

pytestmark = pytest.mark.skipif(ops.load_extension() is None, reason="fused kernels disabled")


def _three_steps(model, cfg, n_blocks: int = 24, block_size: int = 16, kv_dtype: str = "float32",
                 prompt_lens: Optional[list[int]] = None,
                 output_rows: Optional[Callable[[int], list[int]]] = None) -> torch.Tensor:
    """Two sequences: a 150-token prefill (in two chunks, spanning attention's 128-key
    partitions) beside a short one, then a mixed step, then two decodes; the hidden states.
    ``prompt_lens``: the sequences' prompt lengths, to run each step with its token roles
    (kvserve/token_roles.py); None: no roles (every row generated). ``output_rows``: a step's
    rows to return, given its number of rows; None: every row."""
    caches = allocate_kv_cache(cfg, n_blocks, block_size, kv_dtype, "cpu")
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, cfg.vocab_size, (200,), generator=gen)
    tables = [list(range(0, 12)), list(range(12, 20))]
    outs = []
    # step 1: seq 0 tokens 0..99, seq 1 tokens 0..9
    steps = [([0, 0], [100, 10]), ([100, 10], [50, 1]), ([150, 11], [1, 1])]
    for context, new in steps:
        md = build_attention_metadata(tables, context, new, block_size)
        rows = torch.cat([ids[c:c + n] + 17 * s for s, (c, n) in enumerate(zip(context, new))]) % cfg.vocab_size
        pos = torch.cat([torch.arange(c, c + n) for c, n in zip(context, new)])
        roles = None
        if prompt_lens is not None:
            seq = torch.cat([torch.full((n,), s) for s, n in enumerate(new)])
            roles = TokenRoles.from_mask((pos < torch.tensor(prompt_lens)[seq]).numpy())
        wanted = None if output_rows is None else torch.tensor(output_rows(len(rows)), dtype=torch.int64)
        with use_token_roles(roles):
            outs.append(model.model(rows, pos, md, caches, wanted))
    return torch.cat(outs)


def test_fused_layers_reject_tokens_and_positions_outside_their_tables():
    """The native call reads the embedding and rope rows itself: an id outside the vocabulary
    or a position past the rope tables is an error, not a read out of bounds."""
    model, cfg = load_model(resolve_model("tiny-llama"))
    fused, decoder = model.model.fused_layers, model.model
    caches = allocate_kv_cache(cfg, 4, 16, "float32", "cpu")
    md = build_attention_metadata([[0]], [0], [2], 16)
    tables = decoder.rope_inv_freq.tables(2, "cpu")
    embed = table_args(decoder.embed_tokens)
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        fused(torch.tensor([1, cfg.vocab_size]), torch.tensor([0, 1]), embed, 1.0, tables, tables, md, caches)
    past = tables[0].shape[0]
    with pytest.raises(RuntimeError, match="past the rope table"):
        fused(torch.tensor([1, 2]), torch.tensor([0, past]), embed, 1.0, tables, tables, md, caches)


@pytest.mark.parametrize("weight_format", [None, "bf16", "int8", "int4"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3", "tiny-qwen3", "tiny-phi3", "tiny-mistral-swa",
                                  "tiny-qwen3-moe"])
def test_fused_layers_match_the_python_model_exactly(name, weight_format):
    model, cfg = load_model(resolve_model(name), quantization=weight_format)
    fused = model.model.fused_layers
    assert fused is not None
    native = _three_steps(model, cfg)
    model.model.fused_layers = None
    try:
        layer_by_layer = _three_steps(model, cfg)
    finally:
        model.model.fused_layers = fused
    assert torch.equal(native, layer_by_layer)
    if weight_format == "int4":
        with ops.use_kernels(False):  # plain torch everywhere
            plain = _three_steps(model, cfg)
        # fp32 noise upstream moves some activations across a bf16 rounding boundary (one bf16
        # ulp, 0.4 %) before the int4 products: the bound is that rounding, not fp32 noise.
        assert (native - plain).abs().max() <= 1e-2 * plain.abs().max()


@pytest.mark.parametrize("copies", ["bf16", "int8"])
@pytest.mark.parametrize("prompt_lens", [[40, 10], [100, 5], [150, 10]])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3", "tiny-qwen3", "tiny-qwen3-moe"])
def test_fused_layers_match_the_python_model_exactly_with_token_roles(name, prompt_lens, copies):
    """int4 with prefill copies (bf16, or int8 under int8 activations): prompt rows through the
    copies, the others through the Q4_1 blocks, in the native loop as in the Python model.
    [40, 10]: the first step's prompt rows are two runs (gathered); [100, 5]: one run per role;
    [150, 10]: an all-prompt step, then one run per role, then all generated."""
    model, cfg = load_model(resolve_model(name), quantization="int4", int4_prefill=copies)
    fused = model.model.fused_layers
    native = _three_steps(model, cfg, prompt_lens=prompt_lens)
    model.model.fused_layers = None
    try:
        layer_by_layer = _three_steps(model, cfg, prompt_lens=prompt_lens)
    finally:
        model.model.fused_layers = fused
    assert torch.equal(native, layer_by_layer)
    # The roles choose the weights: without them every row is Q4_1.
    assert not torch.equal(native, _three_steps(model, cfg))
    with ops.use_kernels(False):  # plain torch everywhere, as in the test above
        plain = _three_steps(model, cfg, prompt_lens=prompt_lens)
    assert (native - plain).abs().max() <= 1e-2 * plain.abs().max()


# Rows of a step of n rows: its last; none (a prompt chunk without logits); its first and last
# (with prompt_lens [40, 10] the first step's are prompt, prompt: one run); a prompt, a
# generated and a prompt row ([40, 10]'s first step: the prompt rows are gathered).
_OUTPUT_ROWS = [lambda n: [n - 1], lambda n: [], lambda n: [0, n - 1], lambda n: sorted({0, n // 2, n - 1})]


@pytest.mark.parametrize("quantization,copies,prompt_lens",
                         [(None, None, None), ("int4", "bf16", [40, 10]), ("int4", "int8", [120, 5])])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3", "tiny-qwen3-moe"])
def test_last_layer_past_attention_computes_only_the_output_rows(name, quantization, copies, prompt_lens):
    """models/base.py's last_layer_rows: the last layer's output projection and MLP see only the
    rows whose hidden states are wanted (each in its own token role), and those rows keep the bits
    they have when every row is computed, natively and layer by layer (the same calls)."""
    kwargs = {} if quantization is None else {"quantization": quantization, "int4_prefill": copies}
    model, cfg = load_model(resolve_model(name), **kwargs)
    fused = model.model.fused_layers
    assert fused is not None
    every_row = _three_steps(model, cfg, prompt_lens=prompt_lens)
    sizes = [110, 51, 2]  # _three_steps' steps
    for choose in _OUTPUT_ROWS:
        wanted = torch.cat([torch.tensor(choose(n), dtype=torch.int64) + sum(sizes[:i]) for i, n in enumerate(sizes)])
        native = _three_steps(model, cfg, prompt_lens=prompt_lens, output_rows=choose)
        assert torch.equal(native, every_row[wanted])
        model.model.fused_layers = None
        try:
            layer_by_layer = _three_steps(model, cfg, prompt_lens=prompt_lens, output_rows=choose)
        finally:
            model.model.fused_layers = fused
        assert torch.equal(layer_by_layer, native)


@pytest.mark.parametrize("name,quantization", [("tiny-llama", None), ("tiny-gemma3", "int4")])
def test_last_layer_rows_and_the_logits_they_gather(name, quantization):
    """The model's forward: logits_indices in any order, repeated (prompt logprobs after the
    sampled rows), or none give the logits the rows have when every row is computed; int4 with
    token roles (the second sequence's last 4 rows generated), natively and layer by layer."""
    from kvserve.models.base import last_layer_rows

    assert last_layer_rows(torch.arange(4), 4)[0] is None  # a decode step: every row
    rows, gather = last_layer_rows(torch.tensor([9, 2, 5, 2]), 12)
    assert rows.tolist() == [2, 5, 9] and rows[gather].tolist() == [9, 2, 5, 2]
    kwargs = {} if quantization is None else {"quantization": quantization, "int4_prefill": "bf16"}
    model, cfg = load_model(resolve_model(name), **kwargs)
    caches = allocate_kv_cache(cfg, 12, 16, "float32", "cpu")
    ids = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(3))
    md = build_attention_metadata([list(range(0, 4)), list(range(4, 8))], [0, 0], [30, 10], 16)
    pos = torch.cat([torch.arange(30), torch.arange(10)])
    roles = {} if quantization is None else {"token_roles": TokenRoles.from_mask((torch.arange(40) < 36).numpy())}
    every = model(ids, pos, md, caches, torch.arange(40), **roles)
    fused = model.model.fused_layers
    assert fused is not None
    for native in (True, False):
        model.model.fused_layers = fused if native else None
        for indices in ([29, 39], [39, 3, 29, 3], [], [0], [37, 2, 38, 35]):
            logits = model(ids, pos, md, caches, torch.tensor(indices, dtype=torch.int64), **roles)
            assert torch.equal(logits, every[indices]), (native, indices)
    model.model.fused_layers = fused


def _one_sequence(model, cfg, block_size: int = 16) -> torch.Tensor:
    """One sequence alone: a 20-token prefill, then three decodes; the hidden states."""
    caches = allocate_kv_cache(cfg, 4, block_size, "float32", "cpu")
    ids = torch.randint(0, cfg.vocab_size, (23,), generator=torch.Generator().manual_seed(5))
    outs = []
    for context, new in [(0, 20), (20, 1), (21, 1), (22, 1)]:
        md = build_attention_metadata([[0, 1, 2, 3]], [context], [new], block_size)
        outs.append(model.model(ids[context:context + new], torch.arange(context, context + new), md, caches))
    return torch.cat(outs)


def _tiny_moe(mlp_only_layers: list[int], weight_format: Optional[str]):
    """tiny-qwen3-moe with dense MLPs on ``mlp_only_layers``, as the loader builds it."""
    from kvserve.models.testing import build_random_model, tiny_config
    from kvserve.quant import convert_linear_layers, use_invariant_fp32_linears

    cfg = tiny_config("qwen3_moe")
    cfg.mlp_only_layers = mlp_only_layers
    model = build_random_model(cfg, seed=2)
    if weight_format is None:
        use_invariant_fp32_linears(model)
    else:
        convert_linear_layers(model, weight_format)
    assert attach_fused_layers(model) is not None
    return model, cfg


# The tiny model's own (a dense middle layer), every layer routed, dense first and last layers,
# and no routed layer at all.
@pytest.mark.parametrize("mlp_only_layers", [[1], [], [0, 2], [0, 1, 2]])
@pytest.mark.parametrize("weight_format", [None, "bf16"])
def test_routed_experts_match_the_python_model_alone_and_batched(weight_format, mlp_only_layers):
    """Qwen3-MoE's routed experts in the native loop (decoder.cpp's RoutedExperts): the router,
    the routing kernel and each chosen expert's linears on its rows, the same bits as the
    modules layer by layer, for one sequence's prefill and decodes and for _three_steps' batched
    and mixed steps, in fp32 and bf16 (the default weights on a CPU with fast bf16)."""
    model, cfg = _tiny_moe(mlp_only_layers, weight_format)
    fused = model.model.fused_layers
    model.model.fused_layers = None
    try:
        layer_by_layer = (_one_sequence(model, cfg), _three_steps(model, cfg))
    finally:
        model.model.fused_layers = fused
    ext = ops.load_extension()
    default = ext.expert_parallel_rows()
    # Decode-sized steps side by side (the default), every step's experts one after another, and
    # every step's side by side (the prefills' experts of many rows, gathered, too).
    for rows in (default, 0, 1 << 20):
        ext.set_expert_parallel_rows(rows)
        try:
            native = (_one_sequence(model, cfg), _three_steps(model, cfg))
        finally:
            ext.set_expert_parallel_rows(default)
        for ours, reference in zip(native, layer_by_layer):
            assert torch.equal(ours, reference), rows


def test_routed_experts_read_only_the_chosen_experts():
    """An expert that no token of the step chose is never read: with every such expert's
    weights NaN, a decode step's hidden states keep their bits (a read would spread the NaN).
    (A decode rewrites its own KV slot before attending: the step can be run again.)"""
    model, cfg = _tiny_moe([1], None)
    caches = allocate_kv_cache(cfg, 2, 16, "float32", "cpu")
    ids = torch.randint(0, cfg.vocab_size, (21,), generator=torch.Generator().manual_seed(5))
    model.model(ids[:20], torch.arange(20), build_attention_metadata([[0, 1]], [0], [20], 16), caches)

    def decode() -> torch.Tensor:
        return model.model(ids[20:], torch.tensor([20]), build_attention_metadata([[0, 1]], [20], [1], 16), caches)

    before = decode()
    chosen: set[tuple[int, int]] = set()
    routed = [(i, layer.mlp) for i, layer in enumerate(model.model.layers) if cfg.is_moe_layer(i)]
    hooks = [expert.register_forward_hook(lambda m, args, out, key=(i, e): chosen.add(key))
             for i, block in routed for e, expert in enumerate(block.experts)]
    fused, model.model.fused_layers = model.model.fused_layers, None  # (the modules' hooks see who runs)
    try:
        assert torch.equal(decode(), before)
    finally:
        for hook in hooks:
            hook.remove()
        model.model.fused_layers = fused
    unread = [(i, e) for i, block in routed for e in range(len(block.experts)) if (i, e) not in chosen]
    assert len(unread) == len(routed) * (cfg.num_experts - cfg.num_experts_per_tok)
    for i, e in unread:
        expert = model.model.layers[i].mlp.experts[e]
        expert.gate_up_proj.weight.fill_(float("nan"))
        expert.down_proj.weight.fill_(float("nan"))
    assert torch.equal(decode(), before)


def test_token_roles_of_rows():
    """TokenRoles.subset: the roles of some rows, renumbered; decoder.cpp's roles_of_rows twin."""
    roles = TokenRoles.from_mask(torch.tensor([True, False, False, True, True]).numpy())
    assert roles.subset(torch.tensor([1, 2])).kind == ALL_GENERATED
    assert roles.subset(torch.tensor([0, 4])).kind == ALL_PROMPT
    part = roles.subset(torch.tensor([0, 2, 3]))
    assert part.kind == MIXED and part.prompt_rows.tolist() == [0, 2] and part.generated_run == (1, 1)
    assert TokenRoles.from_mask(torch.tensor([True]).numpy()).subset(torch.tensor([0])).kind == ALL_PROMPT


def _first_layers(model, cfg, n: int):
    """The model cut to its first ``n`` decoder layers (fused loop re-attached) and its config."""
    model.model.layers = model.model.layers[:n]
    short = copy.copy(cfg)
    short.num_hidden_layers = n
    if short.layer_types:
        short.layer_types = short.layer_types[:n]
    assert attach_fused_layers(model) is not None
    return model, short


def test_fused_layers_match_the_python_model_with_gemma_files_own_blocks():
    """Gemma 3's int4 mode reads its file's Q5_0, Q8_0 (fused with Q5_0 in q/k/v: segments),
    Q4_K and Q6_K blocks: the native loop equals the Python model bit for bit, with and
    without token roles, and both stay near plain torch.

    "Near plain torch" is checked on the first three layers (every block format is there):
    through all 18 the comparison measures the model's sensitivity, not the kernels. With
    prompt rows through the bf16 copies (bf16-rounded activations by definition), plain torch
    against itself with 1-ulp noise on the embeddings already differs by 1.3 % of the largest
    value after 18 layers (measured on this test's tokens), more than the bound; after three
    layers the kernels are within 0.4 %."""
    from kvserve.quant import Int4Linear, Q5Linear, Q8Linear, SegmentedLinear

    model, cfg = load_model(resolve_model("gemma-3-270m"), quantization="int4")
    kinds = {type(m) for m in model.model.layers.modules()}
    block_kinds = {Int4Linear, Q5Linear, Q8Linear, SegmentedLinear}
    assert block_kinds <= kinds
    fused = model.model.fused_layers
    assert fused is not None
    for prompt_lens in (None, [100, 5]):
        native = _three_steps(model, cfg, n_blocks=24, prompt_lens=prompt_lens)
        model.model.fused_layers = None
        try:
            layer_by_layer = _three_steps(model, cfg, n_blocks=24, prompt_lens=prompt_lens)
        finally:
            model.model.fused_layers = fused
        assert torch.equal(native, layer_by_layer), prompt_lens
    model, cfg = _first_layers(model, cfg, 3)
    assert block_kinds <= {type(m) for m in model.model.layers.modules()}
    for prompt_lens in (None, [100, 5]):
        native = _three_steps(model, cfg, n_blocks=24, prompt_lens=prompt_lens)
        with ops.use_kernels(False):
            plain = _three_steps(model, cfg, prompt_lens=prompt_lens)
        assert (native - plain).abs().max() <= 1e-2 * plain.abs().max(), prompt_lens


def test_token_roles_kinds():
    assert TokenRoles.from_mask(torch.tensor([True, True]).numpy()).kind == ALL_PROMPT
    roles = TokenRoles.from_mask(torch.tensor([True, False, True]).numpy())
    assert roles.kind == MIXED and roles.prompt_run is None and roles.generated_run == (1, 1)
    assert roles.prompt_rows.tolist() == [0, 2]


@pytest.mark.parametrize("weight_format", [None, "int4"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma3", "tiny-qwen3", "tiny-phi3"])
def test_fused_layers_match_the_python_model_exactly_with_int8_kv(name, weight_format):
    """The native loop quantizes and reads an int8 cache through the same kernels."""
    model, cfg = load_model(resolve_model(name), quantization=weight_format)
    fused = model.model.fused_layers
    native = _three_steps(model, cfg, kv_dtype="int8")
    model.model.fused_layers = None
    try:
        layer_by_layer = _three_steps(model, cfg, kv_dtype="int8")
    finally:
        model.model.fused_layers = fused
    assert torch.equal(native, layer_by_layer)
    # And the plain-torch path (torch quantization, attention over a dequantized copy): the
    # kernel's int16 queries and weights differ from it by ~1e-5, and such noise upstream moves
    # some later layer's K/V across an int8 rounding boundary (one step, 1/127 of a head's
    # range): the bound is that rounding, not fp32 noise.
    if weight_format is None:
        with ops.use_kernels(False):
            plain = _three_steps(model, cfg, kv_dtype="int8")
        assert (native - plain).abs().max() <= 1e-2 * plain.abs().max()


def test_fused_layers_only_where_the_kernels_run():
    model, _ = load_model(resolve_model("tiny-llama"), dtype=torch.bfloat16)  # a pure bf16 model
    assert model.model.fused_layers is None
    model, _ = load_model(resolve_model("tiny-llama"), quantization="int4")
    with ops.use_kernels(False):
        assert not model.model.fused_layers.applies_to(model.model.embed_tokens, [])


def _three_steps_grouped(model, cfg, kv_dtype: str, grouped: bool, block_size: int = 8) -> torch.Tensor:
    """``_three_steps`` on the engine's layout: one block table per KV cache group, sliding
    groups' entries before the window on the null block (0), as the KV manager leaves them."""
    from kvserve.kv_cache import KVCacheSpec
    spec = KVCacheSpec.for_model(cfg, block_size, kv_dtype, reclaim_sliding_window=grouped)
    lens = [151, 12]
    per_seq = [-(-n // block_size) for n in lens]
    caches = allocate_kv_cache(cfg, 1 + spec.num_groups * sum(per_seq), block_size, kv_dtype, "cpu",
                               reclaim_sliding_window=grouped)
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, cfg.vocab_size, (200,), generator=gen)
    tables, next_id = [], 1
    for _ in spec.groups:
        group_tables = []
        for n in per_seq:
            group_tables.append(list(range(next_id, next_id + n)))
            next_id += n
        tables.append(group_tables)
    outs = []
    steps = [([0, 0], [100, 10]), ([100, 10], [50, 1]), ([150, 11], [1, 1])]
    for context, new in steps:
        step_tables = []
        for group, group_tables in zip(spec.groups, tables):
            step_tables.append([])
            for c, table in zip(context, group_tables):
                # What no query of this step or later sees is released: the null block.
                first = max(0, c - group.window + 1) // block_size if group.window else 0
                step_tables[-1].append([0] * first + table[first:])
        md = build_attention_metadata(step_tables[0], context, new, block_size, group_block_tables=step_tables[1:])
        rows = torch.cat([ids[c:c + n] + 17 * s for s, (c, n) in enumerate(zip(context, new))]) % cfg.vocab_size
        pos = torch.cat([torch.arange(c, c + n) for c, n in zip(context, new)])
        outs.append(model.model(rows, pos, md, caches))
    return torch.cat(outs)


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_sliding_window_groups_match_one_group_exactly(kv_dtype):
    """Per-group block tables with released blocks on the null block (int8 tiles read from a
    16-key grid, so with 8-token blocks they read the null block and mask it): the same numbers
    as one table for every layer, native and layer by layer."""
    model, cfg = load_model(resolve_model("tiny-gemma3"))
    fused = model.model.fused_layers
    one_group = _three_steps_grouped(model, cfg, kv_dtype, grouped=False)
    native = _three_steps_grouped(model, cfg, kv_dtype, grouped=True)
    model.model.fused_layers = None
    try:
        layer_by_layer = _three_steps_grouped(model, cfg, kv_dtype, grouped=True)
    finally:
        model.model.fused_layers = fused
    assert torch.equal(native, one_group)
    assert torch.equal(layer_by_layer, one_group)


@pytest.mark.parametrize("name,spec", [("tiny-llama", dict(norm_offset=0.0, qk_norm=False)),
                                       ("tiny-qwen3", dict(norm_offset=0.0, qk_norm=True)),
                                       ("tiny-gemma3", dict(norm_offset=1.0, qk_norm=True))])
def test_each_architecture_declares_its_native_layer(name, spec):
    """The native decoder reads the architecture's declared layer spec (models/spec.py), not
    attribute names: Qwen3's q/k norms are plain x * w, Gemma 3's x * (1 + w)."""
    model, _ = load_model(resolve_model(name))
    for key, value in spec.items():
        assert getattr(model.layer_spec, key) == value
    assert model.model.fused_layers is not None
