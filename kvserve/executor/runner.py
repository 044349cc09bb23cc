"""Model runner: turns a StepInput (the executor seam's plain step snapshot) into tensors,
runs the model and the sampler, and keeps the per-request state sampling needs.

Device-agnostic: everything is built on the host with numpy and moved to ``device`` in one
copy per tensor, so the same code serves CPU and CUDA.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch

from kvserve.attention import AttentionMetadata
from kvserve.config import ModelConfig
from kvserve.kv_cache import KVCache, KVCacheSpec
from kvserve.executor.step import LateBitmasks, NewRequestData, StepInput, StepOutput
from kvserve.request import SamplingParams
from kvserve.row_table import MAPPED_ROWS_RELEASE_STEPS, mapped_row_tables
from kvserve.quant import has_prefill_copies
from kvserve.sampler import Sampler, SamplingMetadata, argmax_suffices, build_sampling_metadata, make_generator
from kvserve.speculative.rejection import rejection_sample
from kvserve.speculative.verify import accept_run
from kvserve.token_roles import ALL_GENERATED, TokenRoles
from kvserve.tracing import label


# The runner's result is the executor seam's StepOutput (kept under its old name too).
RunnerOutput = StepOutput


class _BitmaskRow:
    """This step's allowed tokens of a constrained request, in the shape the sampler reads a
    grammar (``fill_bitmask``): the grammar itself lives with the engine."""

    __slots__ = ("row",)

    def __init__(self, row: np.ndarray) -> None:
        self.row = row

    def fill_bitmask(self, bitmask: np.ndarray, index: int) -> None:
        bitmask[index] = self.row


class _BitmaskToCome:
    """(Async scheduling) A constrained request whose bitmask arrives after the forward pass
    (StepInput.late_grammar_request_ids): it marks the row as constrained (no argmax-only
    shortcut) until ``ModelRunner`` swaps in the real row."""

    __slots__ = ()

    def fill_bitmask(self, bitmask: np.ndarray, index: int) -> None:
        raise RuntimeError("a late grammar bitmask was sampled with before it arrived")


_BITMASK_TO_COME = _BitmaskToCome()


class RequestState:
    """What the runner remembers of a request between steps: its sampling parameters, its
    own RNG (seeded once, so the stream continues across steps and preemptions) and the
    tokens it has produced (penalties, min_tokens). The sampler's row (sampler.SamplingRow)."""

    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "eos_token_ids",
                 "generator", "output_token_ids", "grammar")

    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 eos_token_ids: list[int], generator: Optional[torch.Generator] = None,
                 output_token_ids: Optional[list[int]] = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.generator = generator
        self.output_token_ids: list[int] = [] if output_token_ids is None else output_token_ids
        self.grammar: Optional[_BitmaskRow] = None

    @classmethod
    def for_new_request(cls, data: NewRequestData, device: torch.device) -> "RequestState":
        generator = None if data.seed is None else make_generator(data.seed, device)
        return cls(data.request_id, data.prompt_token_ids, data.sampling_params, data.eos_token_ids, generator)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor
    # One row per logits row: a speculating request appears once per verified position.
    sampled_requests: list[RequestState]
    # Per sampled request, in row order: its drafts ([] for a plain decode or prefill).
    drafts: list[list[int]]
    num_prefill_tokens: int
    num_decode_tokens: int
    # Which rows are prompt positions, for a model whose linears have a prefill format (else None).
    token_roles: Optional[TokenRoles] = None
    # Prompt logprobs: logits rows after the sampled ones, the prompt token each row predicts,
    # and (request, number of rows) in row order.
    prompt_targets: list[int] = field(default_factory=list)
    prompt_owners: list[tuple[RequestState, int]] = field(default_factory=list)
    # Per sampled request, in row order: a model drafter's distributions q (rejection
    # sampling), or None.
    draft_probs: list = field(default_factory=list)


class ModelRunner:
    """Runs steps on one model (or one rank's shard of it): ``execute(StepInput) -> StepOutput``.

    ``samples``: whether this runner samples. Every rank of a parallel group computes the same
    logits; only the one that answers the engine samples (the others' RNGs would otherwise
    have to be kept in step for nothing).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        model_config: ModelConfig,
        kv_spec: KVCacheSpec,
        num_blocks: int,
        device: torch.device,
        samples: bool = True,
    ) -> None:
        self.model = model
        self.model_config = model_config
        self.block_size = kv_spec.block_size
        self.device = device
        self.kv_cache = KVCache.allocate(kv_spec, num_blocks, device)
        self.sampler = Sampler()
        self.samples = samples
        self.requests: dict[str, RequestState] = {}
        # Int4 layers with prefill copies (bf16 or int8): the model is told each row's role.
        self.wants_token_roles = has_prefill_copies(model)
        # Greedy argmax-only decode steps, alone or as a multi-step round, in one native call
        # where the model allows (PagedCausalLM.decode_round); off, they step through the model
        # in Python (tests and benchmarks compare the two).
        self.native_rounds = True
        # Async scheduling (the engine does not know a step's tokens when it builds the next):
        # this runner appends each sampled token to its request's history itself, feeds it to
        # the next step's placeholder, and takes late bitmasks from ``receive_late_bitmasks``.
        self.appends_sampled_tokens = False
        self.receive_late_bitmasks: Optional[Callable[[], LateBitmasks]] = None
        # Tables read in place from the model file, whose pages go back every so many steps.
        self.mapped_tables = mapped_row_tables(model)
        self.steps_since_release = 0

    def update_states(self, step: StepInput) -> None:
        for rid in step.finished_request_ids:
            self.requests.pop(rid, None)
        for data in step.new_requests:
            self.requests[data.request_id] = RequestState.for_new_request(data, self.device)
        for chunk in step.chunks:
            state = self.requests[chunk.request_id]
            if chunk.new_output_token_ids:
                state.output_token_ids.extend(chunk.new_output_token_ids)
            if chunk.feeds_last_sampled:
                chunk.token_ids[-1] = state.output_token_ids[-1]
            if chunk.needs_sample:
                row = step.grammar_bitmasks.get(chunk.request_id)
                state.grammar = None if row is None else _BitmaskRow(row)
        for rid in step.late_grammar_request_ids:
            self.requests[rid].grammar = _BITMASK_TO_COME

    def _take_late_bitmasks(self, step: StepInput) -> None:
        """Wait for the bitmasks this step's late constrained requests sample with."""
        if self.receive_late_bitmasks is None:
            raise RuntimeError("a step with late grammar bitmasks, but no channel they come on")
        late = self.receive_late_bitmasks()
        for rid in step.late_grammar_request_ids:
            self.requests[rid].grammar = _BitmaskRow(late.bitmasks[rid])

    def prepare_inputs(self, step: StepInput) -> ModelInputs:
        block_size = self.block_size
        n_tokens = step.num_tokens
        input_ids = np.empty(n_tokens, dtype=np.int64)
        positions = np.empty(n_tokens, dtype=np.int64)
        # One table per KV cache group; group g's tokens go to its own blocks (same offsets).
        num_groups = len(step.chunks[0].block_tables)
        max_blocks = max(len(t) for c in step.chunks for t in c.block_tables)
        block_tables = np.zeros((num_groups, len(step.chunks), max_blocks), dtype=np.int32)
        slot_mapping = np.empty((num_groups, n_tokens), dtype=np.int64)
        query_start_loc = [0]
        context_lens: list[int] = []
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        sampled_requests: list[RequestState] = []
        prompt_rows: list[int] = []
        prompt_targets: list[int] = []
        prompt_owners: list[tuple[RequestState, int]] = []
        drafts: list[list[int]] = []
        draft_probs: list = []
        n_prefill = n_decode = 0
        # A row is a prompt token when its position is within the request's prompt; the rest
        # (generated tokens, also when recomputed after preemption, and drafts) are not.
        is_prompt = np.zeros(n_tokens, dtype=bool) if self.wants_token_roles else None
        num_prompt_rows = 0

        offset = 0
        for row, chunk in enumerate(step.chunks):
            start = chunk.start_position
            n = len(chunk.token_ids)
            end = start + n
            input_ids[offset:offset + n] = chunk.token_ids
            if is_prompt is not None:
                num_prompt = self.requests[chunk.request_id].num_prompt_tokens
                prompt_here = max(0, min(end, num_prompt) - start)
                is_prompt[offset:offset + prompt_here] = True
                num_prompt_rows += prompt_here
            if n == 1:  # a decode: plain ints (numpy's per-call cost is most of a one-token chunk's)
                positions[offset] = start
                for g, group_table in enumerate(chunk.block_tables):
                    block_tables[g, row, :len(group_table)] = group_table
                    slot_mapping[g, offset] = group_table[start // block_size] * block_size + start % block_size
            else:
                pos = np.arange(start, end, dtype=np.int64)
                positions[offset:offset + n] = pos
                for g, group_table in enumerate(chunk.block_tables):
                    table = np.asarray(group_table, dtype=np.int64)
                    block_tables[g, row, :len(table)] = table
                    slot_mapping[g, offset:offset + n] = table[pos // block_size] * block_size + pos % block_size
            if chunk.num_prompt_logprobs_done is not None:
                req = self.requests[chunk.request_id]
                # Position p's logits predict prompt token p + 1; those already computed (a
                # chunk recomputed after preemption) are not asked again.
                first = max(start, chunk.num_prompt_logprobs_done)
                last = min(end, req.num_prompt_tokens - 1)
                if last > first:
                    prompt_rows.extend(range(offset + first - start, offset + last - start))
                    prompt_targets.extend(req.prompt_token_ids[first + 1:last + 1])
                    prompt_owners.append((req, last - first))
            offset += n
            query_start_loc.append(offset)
            context_lens.append(start)
            seq_lens.append(end)
            if chunk.needs_sample:
                # A verify pass needs logits at the last real token and at every draft.
                num_rows = chunk.num_drafts + 1
                logits_indices.extend(range(offset - num_rows, offset))
                sampled_requests.extend([self.requests[chunk.request_id]] * num_rows)
                drafts.append(chunk.token_ids[n - chunk.num_drafts:] if chunk.num_drafts else [])
                draft_probs.append(torch.from_numpy(chunk.draft_probs).to(self.device)
                                   if chunk.num_drafts and chunk.draft_probs is not None else None)
            if chunk.is_prefill:
                n_prefill += n
            else:
                n_decode += n

        # Every integer the step needs in two buffers (int64, int32), each moved to the device in
        # one copy and cut into views, where a dozen small tensors were built (and copied to the
        # device) one by one: a few microseconds each on the CPU, more with their code and data
        # evicted by the weights the last step streamed.
        num_rows = len(logits_indices) + len(prompt_rows)
        wide = np.empty((2 + num_groups) * n_tokens + num_rows, dtype=np.int64)
        wide[:n_tokens], wide[n_tokens:2 * n_tokens] = input_ids, positions
        wide[2 * n_tokens:(2 + num_groups) * n_tokens] = slot_mapping.ravel()
        wide[(2 + num_groups) * n_tokens:] = logits_indices + prompt_rows
        num_seqs = len(step.chunks)
        narrow = np.empty(2 * num_seqs + 1 + block_tables.size, dtype=np.int32)
        narrow[:num_seqs], narrow[num_seqs:2 * num_seqs + 1] = seq_lens, query_start_loc
        narrow[2 * num_seqs + 1:] = block_tables.ravel()
        wide_t, narrow_t = torch.from_numpy(wide), torch.from_numpy(narrow)
        if self.device.type != "cpu":
            wide_t, narrow_t = wide_t.to(self.device), narrow_t.to(self.device)
        # (split_with_sizes: Tensor.split's Python wrapper costs as much as the split)
        ids_t, positions_t, slots_t, logits_t = wide_t.split_with_sizes([n_tokens, n_tokens, num_groups * n_tokens, num_rows])
        seq_lens_t, qsl_t, tables_t = narrow_t.split_with_sizes([num_seqs, num_seqs + 1, block_tables.size])
        slot_mappings = slots_t.view(num_groups, n_tokens)
        tables = tables_t.view(block_tables.shape)
        attn = AttentionMetadata(
            slot_mapping=slot_mappings[0],
            block_tables=tables[0],
            group_slot_mappings=[slot_mappings[g] for g in range(1, num_groups)],
            group_block_tables=[tables[g] for g in range(1, num_groups)],
            query_start_loc=query_start_loc,
            context_lens=context_lens,
            seq_lens=seq_lens,
            block_size=block_size,
            seq_lens_tensor=seq_lens_t,
            query_start_loc_tensor=qsl_t,
        )
        return ModelInputs(
            input_ids=ids_t,
            positions=positions_t,
            attn_metadata=attn,
            logits_indices=logits_t,
            sampled_requests=sampled_requests,
            drafts=drafts,
            num_prefill_tokens=n_prefill,
            num_decode_tokens=n_decode,
            token_roles=None if is_prompt is None else TokenRoles.from_mask(is_prompt, self.device, num_prompt_rows),
            prompt_targets=prompt_targets,
            prompt_owners=prompt_owners,
            draft_probs=draft_probs,
        )

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        out = self._execute(step)
        self.steps_since_release += 1
        if self.mapped_tables and self.steps_since_release >= MAPPED_ROWS_RELEASE_STEPS:
            for table in self.mapped_tables:
                table.release_pages()
            self.steps_since_release = 0
        if self.appends_sampled_tokens:
            for rid, tokens in out.sampled.items():
                self.requests[rid].output_token_ids.extend(tokens)
        return out

    def _execute(self, step: StepInput) -> StepOutput:
        self.update_states(step)
        if not step.chunks:
            return StepOutput()
        with label("runner.prepare_inputs"):
            inputs = self.prepare_inputs(step)
        if step.num_steps > 1:
            self._check_round(step)  # (before any step of the round writes its KV)
        phase = "model.forward.decode" if inputs.num_prefill_tokens == 0 else "model.forward.prefill"
        argmax_only = self._argmax_only(inputs)
        if argmax_only and self._native_steps_apply(step, inputs):
            with label(phase):
                tokens = self.model.decode_round(step.num_steps, inputs.input_ids, inputs.positions,
                                                 inputs.attn_metadata, self.kv_cache, self.block_size)
            if tokens is not None:
                out = StepOutput(num_prefill_tokens=0, num_decode_tokens=inputs.num_decode_tokens)
                return self._round_output(inputs, tokens.t().tolist(), step.num_steps, out)
        with label(phase):
            # (Only a model with dual-format linears is given the roles: others take no such argument.)
            roles = {} if inputs.token_roles is None else {"token_roles": inputs.token_roles}
            logits = self.model(
                inputs.input_ids, inputs.positions, inputs.attn_metadata, self.kv_cache,
                inputs.logits_indices, **roles, argmax_only=argmax_only, transient_logits=True,
                argmax_tokens=argmax_only,
            )
        out = StepOutput(num_prefill_tokens=inputs.num_prefill_tokens,
                         num_decode_tokens=inputs.num_decode_tokens)
        if not self.samples or logits is None:  # None: a pipeline stage before the last
            return out
        if step.late_grammar_request_ids:
            # (The forward pass above ran while the engine advanced these grammars.)
            with label("runner.wait_late_bitmasks"):
                self._take_late_bitmasks(step)
        num_sampled = len(inputs.sampled_requests)
        if inputs.prompt_targets:
            with label("prompt_logprobs"):
                self._prompt_logprobs(logits[num_sampled:], inputs, out)
            logits = logits[:num_sampled]
        if not inputs.sampled_requests:
            return out
        if any(q is not None for q in inputs.draft_probs):
            with label("sampler"):
                self._verify_with_draft_probs(logits, inputs, out)
            return out
        with label("sampler"):
            # (int64 [S]: the LM head's own argmax of each row, for an argmax-only step)
            head_tokens = logits.dtype == torch.int64
            vocab = self.model_config.vocab_size if head_tokens else logits.shape[-1]
            md = build_sampling_metadata(inputs.sampled_requests, vocab, logits.device)
            sampler_out = None if head_tokens else self.sampler(logits, md)
            token_ids = (logits if sampler_out is None else sampler_out.sampled_token_ids).tolist()
        if step.num_steps > 1:
            return self._decode_steps(step, inputs, md, argmax_only, token_ids, out)
        row = 0
        for spec in inputs.drafts:
            req = inputs.sampled_requests[row]
            num_rows = len(spec) + 1
            tokens = accept_run(spec, token_ids[row:row + num_rows]) if spec else [token_ids[row]]
            out.sampled[req.request_id] = tokens
            if sampler_out is not None and sampler_out.logprobs is not None and sampler_out.logprobs[row] is not None:
                out.logprobs[req.request_id] = sampler_out.logprobs[row:row + len(tokens)]
            row += num_rows
        return out

    def _decode_steps(self, step: StepInput, inputs: ModelInputs, sampling: SamplingMetadata, argmax_only: bool,
                      token_ids: list[int], out: StepOutput) -> StepOutput:
        """The rest of a multi-step round (StepInput.num_steps; the scheduler sends only rounds
        where every row is one request's decode whose sampling reads nothing the token before
        changed, so ``sampling`` serves every step): each step feeds every request the token
        the step before sampled, one position on, into the lookahead slots its block tables
        hold, through the same model call and sampler as a step of its own (the same kernels on
        the same rows: the same tokens). What it saves is the engine's work between steps:
        scheduling, building and preparing the step, applying its outputs."""
        num_steps, block_size = step.num_steps, self.block_size  # (a round execute checked)
        md = inputs.attn_metadata
        positions, input_ids = inputs.positions, inputs.input_ids
        sampled = [[t] for t in token_ids]
        # (Greedy argmax-only rounds the model runs natively never get here: see execute.)
        rows = torch.arange(positions.shape[0], device=positions.device)
        groups = list(zip(md.all_slot_mappings(), md.all_block_tables()))
        forward = self.model.forward  # (the module's __call__ adds nothing here but its cost)
        for _ in range(num_steps - 1):
            input_ids.copy_(torch.tensor(token_ids, dtype=input_ids.dtype))
            positions += 1
            blocks, offsets = positions // block_size, positions % block_size
            for slots, tables in groups:
                torch.add(offsets, tables[rows, blocks], alpha=block_size, out=slots)
            md.seq_lens_tensor += 1
            # The step's metadata is this step's own: advance it in place, and drop what the
            # layers derived from the last step's.
            md.context_lens[:] = [n + 1 for n in md.context_lens]
            md.seq_lens[:] = [n + 1 for n in md.seq_lens]
            md.derived.clear()
            with label("model.forward.decode"):
                logits = forward(input_ids, positions, md, self.kv_cache, inputs.logits_indices,
                                 argmax_only=argmax_only, transient_logits=True, argmax_tokens=argmax_only)
            with label("sampler"):
                token_ids = (logits if logits.dtype == torch.int64 else
                             self.sampler(logits, sampling).sampled_token_ids).tolist()
            for tokens, token in zip(sampled, token_ids):
                tokens.append(token)
        return self._round_output(inputs, sampled, num_steps, out)

    def _check_round(self, step: StepInput) -> None:
        """Every row of a multi-step round is one request's decode with a slot for every step
        (else block 0 would take the writes)."""
        num_steps, block_size = step.num_steps, self.block_size
        for chunk in step.chunks:
            if len(chunk.token_ids) != 1 or chunk.is_prefill or not chunk.needs_sample or chunk.num_drafts or any(
                    len(table) * block_size < chunk.start_position + num_steps for table in chunk.block_tables):
                raise RuntimeError(f"request {chunk.request_id}: not a row a {num_steps}-step round can take")

    def _native_steps_apply(self, step: StepInput, inputs: ModelInputs) -> bool:
        """Whether an argmax-only step (and the rest of its round) may run as one native call
        (PagedCausalLM.decode_round, which declines where the model does not run on the fused
        layers): every row one request's decode, sampled, without drafts. The same kernels in the
        same order as the model's forward, the final norm and the head's argmax: the same tokens
        (tested), without the ~0.15 ms of Python a step of a single int4 SmolLM2 stream spent
        between them."""
        return (self.native_rounds and self.samples and inputs.num_prefill_tokens == 0
                and len(inputs.sampled_requests) == inputs.input_ids.shape[0] == len(step.chunks)
                and not any(inputs.drafts) and hasattr(self.model, "decode_round")
                and (inputs.token_roles is None or inputs.token_roles.kind == ALL_GENERATED))

    @staticmethod
    def _round_output(inputs: ModelInputs, sampled: list[list[int]], num_steps: int, out: StepOutput) -> StepOutput:
        for req, tokens in zip(inputs.sampled_requests, sampled):
            out.sampled[req.request_id] = tokens
        out.num_decode_tokens *= num_steps
        return out

    @staticmethod
    def _argmax_only(inputs: ModelInputs) -> bool:
        """Whether the step reads only the argmax of its logits rows: no prompt logprobs, no
        draft probabilities to verify against, and sampling that is plain greedy."""
        return (bool(inputs.sampled_requests) and not inputs.prompt_targets
                and all(q is None for q in inputs.draft_probs) and argmax_suffices(inputs.sampled_requests))

    def _verify_with_draft_probs(self, logits: torch.Tensor, inputs: ModelInputs, out: StepOutput) -> None:
        """A step where some requests verify a draft model's samples (temperature > 0): those
        go through rejection sampling against the draft's q, the rest through the sampler as
        usual. Logprobs are the raw model's, for the tokens finally emitted."""
        vocab = logits.shape[-1]
        rows: list[list[int]] = []
        row = 0
        for spec in inputs.drafts:
            rows.append(list(range(row, row + len(spec) + 1)))
            row += len(spec) + 1
        plain = [r for rs, q in zip(rows, inputs.draft_probs) if q is None for r in rs]
        tokens_by_row: dict[int, int] = {}
        if plain:
            index = torch.tensor(plain, dtype=torch.int64, device=logits.device)
            md = build_sampling_metadata([inputs.sampled_requests[r] for r in plain], vocab, logits.device)
            sampled = self.sampler(logits.index_select(0, index), md).sampled_token_ids.tolist()
            tokens_by_row.update(zip(plain, sampled))
        spec_rows = [r for rs, q in zip(rows, inputs.draft_probs) if q is not None for r in rs]
        index = torch.tensor(spec_rows, dtype=torch.int64, device=logits.device)
        spec_requests = [inputs.sampled_requests[r] for r in spec_rows]
        md = build_sampling_metadata(spec_requests, vocab, logits.device)
        probs = Sampler.processed_probs(Sampler.apply_logits_processors(logits.index_select(0, index).float(), md), md)
        local = {r: i for i, r in enumerate(spec_rows)}
        for rs, spec, q in zip(rows, inputs.drafts, inputs.draft_probs):
            req = inputs.sampled_requests[rs[0]]
            if q is None:
                tokens = accept_run(spec, [tokens_by_row[r] for r in rs]) if spec else [tokens_by_row[rs[0]]]
            else:
                p = probs[local[rs[0]]:local[rs[-1]] + 1]
                tokens = rejection_sample(spec, p, q, req.generator)
            out.sampled[req.request_id] = tokens
            wanted = req.sampling_params.logprobs
            if wanted is not None:
                lp_rows = torch.tensor(rs[:len(tokens)], dtype=torch.int64, device=logits.device)
                raw = torch.log_softmax(logits.index_select(0, lp_rows).float(), dim=-1)
                targets = torch.tensor(tokens, dtype=torch.int64, device=logits.device)
                entries = Sampler.target_logprobs(raw, targets, wanted)
                out.logprobs[req.request_id] = entries

    def _prompt_logprobs(self, logits: torch.Tensor, inputs: ModelInputs, out: StepOutput) -> None:
        targets = torch.tensor(inputs.prompt_targets, dtype=torch.int64, device=logits.device)
        num_top = max(req.sampling_params.prompt_logprobs for req, _ in inputs.prompt_owners)
        entries = Sampler.target_logprobs(torch.log_softmax(logits.float(), dim=-1), targets, num_top)
        row = 0
        for req, count in inputs.prompt_owners:
            wanted = req.sampling_params.prompt_logprobs
            chunk = []
            for entry in entries[row:row + count]:
                # Keep the target (first) and this request's own number of alternatives.
                items = list(entry.items())
                chunk.append(dict(items[:1] + [kv for kv in items[1:] if kv[1].rank <= wanted]))
            out.prompt_logprobs[req.request_id] = chunk
            row += count
