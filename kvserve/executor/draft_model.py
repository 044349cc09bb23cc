"""The ``draft_model`` drafter: a smaller (or lower-precision) model proposes the drafts.

Its KV lives in the target's block pool: a second ``KVCache`` with the draft's shapes and the
same number of blocks, indexed by the request's own block table. A request's blocks hold the
target's KV in one cache and the draft's in the other, so the draft needs no allocator of its
own and its KV is freed, rolled back (rejected drafts) and preempted with the request's blocks;
the engine sizes the pool by target + draft bytes per block.

The draft proposes after the scheduler has allocated the step's lookahead slots (the
``Speculator`` plans k placeholder drafts per request, the scheduler budgets and trims them,
then ``fill`` replaces them): its proposals write KV at positions ``N - 1 .. N + k - 2``
(N = the request's tokens), inside the ``N + k`` the verify pass holds.

Per request the drafter remembers how many leading tokens its cache holds. KV the draft wrote
for a draft that was then accepted stays valid; the rest is recomputed. A step's first draft
forward is a catch-up prefill over the missing tokens ending at the last token (batched over
the drafting requests), the k - 1 after it are single-token decodes. The draft never trusts
prefix-cached blocks (the request that filled them may not have drafted): a request's draft
starts from its first token, and after a preemption starts again. Whatever the draft's cache
holds, outputs stay the target's (greedy: longest matching prefix; sampling: rejection
sampling against the draft's distribution ``q``), so stale draft KV costs acceptance only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch

from kvserve import ops
from kvserve.attention import build_attention_metadata
from kvserve.batch import ScheduledChunk
from kvserve.config import ConfigError, ModelConfig
from kvserve.kv_cache import KVCache, KVCacheSpec
from kvserve.executor.builder import child_index, token_slice
from kvserve.executor.runner import RequestState
from kvserve.sampler import Sampler, build_sampling_metadata, exponential_race, make_generator
from kvserve.config.speculative import SpeculativeConfig

# Mixed into a seeded request's seed for the draft's own random stream: the target's sampler
# (in the runner, possibly another process) draws from seed + child index, and the draft's
# samples must be independent of the uniforms that accept or reject them.
DRAFT_SEED_SALT = 0x5EED_D2AF


def draft_seed(request) -> Optional[int]:
    """The seed of a seeded request's draft stream (None: unseeded, the shared generator)."""
    params = request.sampling_params
    if params.seed is None:
        return None
    return (params.seed + child_index(request.request_id, params.n)) ^ DRAFT_SEED_SALT


# Stands for a draft the model has not proposed yet (between planning and ``fill``); never
# reaches the target model.
PLACEHOLDER = -1


@dataclass
class DraftModel:
    model: torch.nn.Module
    config: ModelConfig
    kv_spec: KVCacheSpec
    weight_format: Optional[str]
    # One draft forward's cost in target decode steps, estimated (see ``relative_cost``).
    relative_cost: float = 0.0


# Bytes per linear weight of each format (int4: Q4_1's 20 bytes per 32 weights).
_WEIGHT_BYTES = {"bf16": 2.0, "int8": 1.0, "int4": 0.625}


def _num_weights(cfg: ModelConfig) -> int:
    """The matmul weights one token's forward reads: the layers' projections and the LM head."""
    h, hd = cfg.hidden_size, cfg.head_dim
    attn = h * cfg.num_attention_heads * hd * 2 + h * cfg.num_key_value_heads * hd * 2
    return cfg.num_hidden_layers * (attn + 3 * h * cfg.intermediate_size) + cfg.vocab_size * h


def relative_cost(draft: ModelConfig, draft_format: Optional[str], target: ModelConfig,
                  target_format: Optional[str], dtype: torch.dtype) -> float:
    """One draft forward's cost in target decode steps. A single-token forward reads every
    weight once and is memory-bound, so: the ratio of the weight bytes they read. Deterministic
    (a timing would make the drafting policy, and with it a seeded request's random stream,
    depend on the machine's load); a lower bound where a format's kernel is compute-bound
    (measured here, int4 costs ~0.65 of bf16, not 0.31)."""
    def weight_bytes(cfg: ModelConfig, fmt: Optional[str]) -> float:
        return _num_weights(cfg) * (_WEIGHT_BYTES[fmt] if fmt else dtype.itemsize)

    return weight_bytes(draft, draft_format) / weight_bytes(target, target_format)


def _peek_config(source) -> ModelConfig:
    """The draft's architecture without loading its weights (fails fast on a vocabulary
    mismatch before seconds of loading)."""
    if source.kind == "tiny":
        from kvserve.models.testing import TINY_MODELS, tiny_config
        return tiny_config(TINY_MODELS[source.name])
    if source.kind == "gguf":
        from kvserve.loader.gguf import config_from_gguf, open_gguf
        return config_from_gguf(open_gguf(source.path))
    from kvserve.loader.safetensors import config_from_hf, read_hf_config
    return config_from_hf(read_hf_config(source.path))


def load_draft_model(spec: SpeculativeConfig, target_config: ModelConfig, target_tokenizer,
                     dtype: torch.dtype, target_weight_format: Optional[str], kv_dtype,
                     block_size: int, device: torch.device, max_model_len: int) -> DraftModel:
    """Load ``spec.model`` with the target's activation dtype and KV dtype, in the weight
    format ``spec.quantization`` (default: the target's). Raises ConfigError unless it shares
    the target's vocabulary: its token ids must mean the target's tokens."""
    from kvserve.tokenizer import load_tokenizer
    from kvserve.loader import load_model, resolve_model

    source = resolve_model(spec.model)
    config = _peek_config(source)
    if config.vocab_size != target_config.vocab_size:
        raise ConfigError(
            f"draft model {spec.model!r} has a vocabulary of {config.vocab_size} tokens, the target "
            f"{target_config.name or 'model'!r} {target_config.vocab_size}: a draft model must share "
            "the target's tokenizer")
    draft_vocab = load_tokenizer(source).hf.get_vocab()
    if draft_vocab != target_tokenizer.hf.get_vocab():
        raise ConfigError(f"draft model {spec.model!r} has a different tokenizer from the target's "
                          "(same size, different tokens): a draft model must share the target's tokenizer")
    if config.max_position_embeddings < max_model_len:
        raise ConfigError(f"draft model {spec.model!r} handles {config.max_position_embeddings} positions, "
                          f"fewer than the target's max_model_len {max_model_len}; lower max_model_len")
    weight_format = target_weight_format if spec.quantization is None else spec.quantization
    weight_format = None if weight_format == "none" else weight_format
    # The draft's forwards carry no token roles (every row is a draft's): no prefill copies.
    model, config = load_model(source, dtype=dtype, device=device, quantization=weight_format,
                               int4_prefill="blocks")
    # One group holding every position: the draft reads the target's full-attention table
    # (group 0), so its own sliding layers, if any, keep their whole context.
    kv_spec = KVCacheSpec.for_model(config, block_size, kv_dtype, reclaim_sliding_window=False)
    cost = relative_cost(config, weight_format, target_config, target_weight_format, dtype)
    return DraftModel(model, config, kv_spec, weight_format, cost)


@dataclass
class _Progress:
    num_computed: int  # leading tokens whose draft KV is valid
    num_preemptions: int  # the request's count when that was recorded


class DraftModelDrafter:
    """Proposes with a model; ``deferred``: the ``Speculator`` plans placeholders before the
    scheduler runs and the engine calls ``fill`` after it."""

    deferred = True

    def __init__(self, draft: DraftModel, num_blocks: int, device: torch.device, k: int) -> None:
        self.model = draft.model
        self.config = draft.config
        self.block_size = draft.kv_spec.block_size
        self.device = device
        self.k = k
        self.relative_cost = draft.relative_cost
        self.kv_cache = KVCache.allocate(draft.kv_spec, num_blocks, device)
        self._progress: dict[str, _Progress] = {}
        self._generators: dict[str, torch.Generator] = {}
        self.num_forwards = 0  # draft forward passes (profiling, tests)

    # ---- the Speculator's side (torch-free) ------------------------------------------------

    def propose(self, token_ids: Sequence[int], k: int | None = None) -> list[int]:
        """A plan: k placeholders, which the scheduler trims to its budget and length rules."""
        return [PLACEHOLDER] * (self.k if k is None else k)

    def retain(self, request_ids: Iterable[str]) -> None:
        alive = set(request_ids)
        self._progress = {rid: p for rid, p in self._progress.items() if rid in alive}
        self._generators = {rid: g for rid, g in self._generators.items() if rid in alive}

    # ---- proposing into the allocated slots --------------------------------------------------

    def _start(self, request) -> int:
        """How many leading tokens of ``request`` the draft's cache holds (valid KV)."""
        prog = self._progress.get(request.request_id)
        if prog is None or prog.num_preemptions != request.num_preemptions:
            return 0  # new, or preempted since: its blocks (and the draft's KV) were given back
        return min(prog.num_computed, request.num_computed_tokens)

    @torch.inference_mode()
    def fill(self, chunks: Sequence[ScheduledChunk], prefill_chunks: Sequence[ScheduledChunk] = ()) -> int:
        """Replace the placeholder drafts of ``chunks`` with the draft model's proposals (and,
        for requests sampled at temperature > 0, set ``chunk.draft_probs`` to the draft's
        processed distributions ``q``, one row per draft). ``prefill_chunks`` (prompt chunks
        of requests likely to draft soon) are computed by the draft in the same first pass, so
        its prompt prefill happens with the target's rather than in the first decode step.
        Returns how many chunks drafted."""
        active = [c for c in chunks if c.spec_token_ids]
        prefill = [c for c in prefill_chunks if not c.spec_token_ids]
        if not active and not prefill:
            return 0
        if len(self._progress) > 2 * len(chunks) + 256:
            self.retain(c.request.request_id for c in chunks)
        num_drafts = [len(c.spec_token_ids) for c in active]
        drafts: list[list[int]] = [[] for _ in active]
        probs: list[list[torch.Tensor]] = [[] for _ in active]
        # First forward: catch up to (and including) each drafting request's last token, and
        # through this step's chunk of each prefilling one.
        tables, context_lens, query_lens, input_ids = [], [], [], []
        for c in active + prefill:
            req = c.request
            if c.spec_token_ids:
                assert req.num_computed_tokens == req.num_tokens - 1, "drafts only follow a decode"
            end = req.num_computed_tokens + c.num_new_tokens - len(c.spec_token_ids)
            start = self._start(req)
            tables.append(c.block_ids)
            context_lens.append(start)
            query_lens.append(end - start)
            input_ids.extend(token_slice(req, start, end))
            self._progress[req.request_id] = _Progress(end, req.num_preemptions)
        rows = list(range(len(active)))
        for step in range(max(num_drafts, default=0) or 1):
            if step > 0:
                rows = [i for i in rows if num_drafts[i] > step]
                tables = [active[i].block_ids for i in rows]
                context_lens = [active[i].request.num_tokens - 1 + step for i in rows]
                query_lens = [1] * len(rows)
                input_ids = [drafts[i][-1] for i in rows]
            tokens, q = self._forward_and_sample([active[i] for i in rows], tables, context_lens,
                                                 query_lens, input_ids)
            for j, i in enumerate(rows):
                drafts[i].append(tokens[j])
                if q is not None and q[j] is not None:
                    probs[i].append(q[j])
        for i, c in enumerate(active):
            req = c.request
            c.spec_token_ids = drafts[i]
            # (numpy: the step snapshot that carries them to the ranks is torch-free)
            c.draft_probs = torch.stack(probs[i]).float().cpu().numpy() if probs[i] else None
            # KV written for positions up to N + k - 2; verification keeps what was accepted.
            self._progress[req.request_id] = _Progress(req.num_tokens - 1 + num_drafts[i], req.num_preemptions)
        return len(active)

    def _draft_generators(self, requests) -> dict[int, torch.Generator]:
        """Row -> the draft's own generator of each seeded request (see ``draft_seed``)."""
        generators = {}
        for row, req in enumerate(requests):
            seed = draft_seed(req)
            if seed is not None:
                if req.request_id not in self._generators:
                    self._generators[req.request_id] = make_generator(seed, self.device)
                generators[row] = self._generators[req.request_id]
        return generators

    def _forward_and_sample(self, chunks: list[ScheduledChunk], tables, context_lens, query_lens,
                            input_ids) -> tuple[list[int], Optional[list[Optional[torch.Tensor]]]]:
        """One draft forward over the sequences given (the first ``len(chunks)`` of them
        sampled at their last token, any after them only computed), then one draft token per
        sampled sequence."""
        dev = self.device
        md = build_attention_metadata(tables, context_lens, query_lens, self.block_size, dev)
        positions = torch.cat([torch.arange(c, c + n, dtype=torch.int64) for c, n in zip(context_lens, query_lens)])
        # (At least one row of logits: a pass that only prefills still runs the LM head once.)
        last_rows = torch.tensor(md.query_start_loc[1:max(2, len(chunks) + 1)], dtype=torch.int64) - 1
        logits = self.model(torch.tensor(input_ids, dtype=torch.int64, device=dev), positions.to(dev), md,
                            self.kv_cache, last_rows.to(dev))
        self.num_forwards += 1
        if not chunks:
            return [], None
        # The request's own processing (logit bias, temperature, top-k/p, min-p), as the
        # target's sampler applies it: rejection sampling compares like with like.
        requests = [c.request for c in chunks]
        rows = [RequestState(r.request_id, r.prompt_token_ids, r.sampling_params, r.eos_token_ids,
                             output_token_ids=r.output_token_ids) for r in requests]
        smd = build_sampling_metadata(rows, logits.shape[-1], logits.device)
        logits = Sampler.apply_logits_processors(logits.float(), smd)
        greedy = ops.argmax(logits)
        if smd.all_greedy:
            return greedy.tolist(), None
        probs = Sampler.processed_probs(logits, smd)
        sampled = exponential_race(probs, self._draft_generators(requests))
        if smd.greedy_mask is not None:
            sampled = torch.where(smd.greedy_mask, greedy, sampled)
        mask = smd.greedy_mask.tolist() if smd.greedy_mask is not None else [False] * len(requests)
        return sampled.tolist(), [None if g else probs[j] for j, g in enumerate(mask)]
