"""Model runner: turns a SchedulerOutput into tensors, runs the model and the sampler.

Device-agnostic: everything is built on the host with numpy and moved to ``device`` in one
copy per tensor, so the same code serves CPU and CUDA.
"""
from __future__ import annotations

from dataclasses import dataclass, field
import numpy as np
import torch

from kvserve.attention import AttentionMetadata
from kvserve.batch import SchedulerOutput
from kvserve.config import ModelConfig
from kvserve.kv_cache import KVCache, KVCacheSpec
from kvserve.request import Logprob, Request
from kvserve.sampler import Sampler, build_sampling_metadata
from kvserve.spec.rejection import rejection_sample
from kvserve.spec.verify import accept_run
from kvserve.tracing import label


@dataclass
class RunnerOutput:
    # Per sampled request, its new tokens: one, or a speculating request's accepted drafts
    # followed by the target's next token. Logprobs likewise, one entry per new token.
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[dict[int, Logprob]]] = field(default_factory=dict)
    # Request id -> logprobs of the prompt tokens this step's chunk predicted, in order.
    prompt_logprobs: dict[str, list[dict[int, Logprob]]] = field(default_factory=dict)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor
    # One row per logits row: a speculating request appears once per verified position.
    sampled_requests: list[Request]
    # Per sampled request, in row order: its drafts ([] for a plain decode or prefill).
    drafts: list[list[int]]
    num_prefill_tokens: int
    num_decode_tokens: int
    # Prompt logprobs: logits rows after the sampled ones, the prompt token each row predicts,
    # and (request, number of rows) in row order.
    prompt_targets: list[int] = field(default_factory=list)
    prompt_owners: list[tuple[Request, int]] = field(default_factory=list)
    # Per sampled request, in row order: a model drafter's distributions q (rejection
    # sampling), or None.
    draft_probs: list = field(default_factory=list)


def token_slice(request: Request, start: int, end: int) -> list[int]:
    """``request.all_token_ids[start:end]`` without concatenating the whole history."""
    prompt = request.prompt_token_ids
    n_prompt = len(prompt)
    if end <= n_prompt:
        return prompt[start:end]
    if start >= n_prompt:
        return request.output_token_ids[start - n_prompt:end - n_prompt]
    return prompt[start:] + request.output_token_ids[:end - n_prompt]


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        model_config: ModelConfig,
        kv_spec: KVCacheSpec,
        num_blocks: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.model_config = model_config
        self.block_size = kv_spec.block_size
        self.device = device
        self.kv_cache = KVCache.allocate(kv_spec, num_blocks, device)
        self.sampler = Sampler()

    def prepare_inputs(self, sched: SchedulerOutput) -> ModelInputs:
        block_size = self.block_size
        n_tokens = sched.total_num_scheduled_tokens
        input_ids = np.empty(n_tokens, dtype=np.int64)
        positions = np.empty(n_tokens, dtype=np.int64)
        # One table per KV cache group; group g's tokens go to its own blocks (same offsets).
        num_groups = len(sched.chunks[0].block_tables)
        max_blocks = max(len(t) for c in sched.chunks for t in c.block_tables)
        block_tables = np.zeros((num_groups, len(sched.chunks), max_blocks), dtype=np.int32)
        slot_mapping = np.empty((num_groups, n_tokens), dtype=np.int64)
        query_start_loc = [0]
        context_lens: list[int] = []
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        sampled_requests: list[Request] = []
        prompt_rows: list[int] = []
        prompt_targets: list[int] = []
        prompt_owners: list[tuple[Request, int]] = []
        drafts: list[list[int]] = []
        draft_probs: list = []
        n_prefill = n_decode = 0

        offset = 0
        for row, chunk in enumerate(sched.chunks):
            req = chunk.request
            start = req.num_computed_tokens
            n = chunk.num_new_tokens
            end = start + n
            spec = chunk.spec_token_ids
            input_ids[offset:offset + n - len(spec)] = token_slice(req, start, end - len(spec))
            if spec:
                input_ids[offset + n - len(spec):offset + n] = spec
            pos = np.arange(start, end, dtype=np.int64)
            positions[offset:offset + n] = pos
            for g, group_table in enumerate(chunk.block_tables):
                table = np.asarray(group_table, dtype=np.int64)
                block_tables[g, row, :len(table)] = table
                slot_mapping[g, offset:offset + n] = table[pos // block_size] * block_size + pos % block_size
            if req.prompt_logprobs is not None:
                # Position p's logits predict prompt token p + 1; those already computed (a
                # chunk recomputed after preemption) are not asked again.
                first = max(start, len(req.prompt_logprobs))
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
                num_rows = len(spec) + 1
                logits_indices.extend(range(offset - num_rows, offset))
                sampled_requests.extend([req] * num_rows)
                drafts.append(list(spec))
                draft_probs.append(chunk.draft_probs if spec else None)
            if chunk.is_prefill:
                n_prefill += n
            else:
                n_decode += n

        dev = self.device
        slot_mappings = torch.from_numpy(slot_mapping).to(dev)
        tables = torch.from_numpy(block_tables).to(dev)
        attn = AttentionMetadata(
            slot_mapping=slot_mappings[0],
            block_tables=tables[0],
            group_slot_mappings=list(slot_mappings[1:]),
            group_block_tables=list(tables[1:]),
            query_start_loc=query_start_loc,
            context_lens=context_lens,
            seq_lens=seq_lens,
            block_size=block_size,
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc_tensor=torch.tensor(query_start_loc, dtype=torch.int32, device=dev),
        )
        return ModelInputs(
            input_ids=torch.from_numpy(input_ids).to(dev),
            positions=torch.from_numpy(positions).to(dev),
            attn_metadata=attn,
            logits_indices=torch.tensor(logits_indices + prompt_rows, dtype=torch.int64, device=dev),
            sampled_requests=sampled_requests,
            drafts=drafts,
            num_prefill_tokens=n_prefill,
            num_decode_tokens=n_decode,
            prompt_targets=prompt_targets,
            prompt_owners=prompt_owners,
            draft_probs=draft_probs,
        )

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        with label("runner.prepare_inputs"):
            inputs = self.prepare_inputs(sched)
        phase = "model.forward.decode" if inputs.num_prefill_tokens == 0 else "model.forward.prefill"
        with label(phase):
            logits = self.model(
                inputs.input_ids, inputs.positions, inputs.attn_metadata, self.kv_cache,
                inputs.logits_indices,
            )
        out = RunnerOutput(num_prefill_tokens=inputs.num_prefill_tokens,
                           num_decode_tokens=inputs.num_decode_tokens)
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
            md = build_sampling_metadata(inputs.sampled_requests, logits.shape[-1], logits.device)
            sampler_out = self.sampler(logits, md)
            token_ids = sampler_out.sampled_token_ids.tolist()
        row = 0
        for spec in inputs.drafts:
            req = inputs.sampled_requests[row]
            num_rows = len(spec) + 1
            tokens = accept_run(spec, token_ids[row:row + num_rows]) if spec else [token_ids[row]]
            out.sampled[req.request_id] = tokens
            if sampler_out.logprobs is not None and sampler_out.logprobs[row] is not None:
                out.logprobs[req.request_id] = sampler_out.logprobs[row:row + len(tokens)]
            row += num_rows
        return out

    def _verify_with_draft_probs(self, logits: torch.Tensor, inputs: ModelInputs, out: RunnerOutput) -> None:
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

    def _prompt_logprobs(self, logits: torch.Tensor, inputs: ModelInputs, out: RunnerOutput) -> None:
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
