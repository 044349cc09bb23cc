"""Offline API: ``LLM(model=...).generate(prompts, params)`` and ``LLM.chat(conversations)``."""
from __future__ import annotations

from typing import Iterator, Optional, Sequence, Union

from tqdm import tqdm

from kvserve.config import DEFAULT_MODEL, EngineArgs
from kvserve.engine import LLMEngine
from kvserve.pooling import EmbeddingOutput
from kvserve.request import RequestOutput, SamplingParams

Prompt = Union[str, list[int], dict]
Message = dict  # {"role": ..., "content": ...}


def _prompt_input(prompt: Prompt) -> Union[str, list[int]]:
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        return prompt["prompt"]
    return prompt


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **engine_kwargs) -> None:
        self.engine = LLMEngine(EngineArgs(model=model, **engine_kwargs))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched; outputs come back in prompt order."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                       else [sampling_params or SamplingParams()] * len(prompts))
        if len(params_list) != len(prompts):
            raise ValueError("sampling_params must be one object or one per prompt")
        ids = [self.engine.add_request(None, _prompt_input(p), sp)
               for p, sp in zip(prompts, params_list)]
        return self._run_to_completion(ids, use_tqdm)

    def chat(
        self,
        conversations: Union[list[Message], Sequence[list[Message]]],
        sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.chat_prompt_ids(conv) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def chat_prompt_ids(self, messages: list[Message]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        # The template already carries BOS where the model wants one.
        return self.tokenizer.encode(text, add_special_tokens=False)

    def embed(self, prompts: Union[Prompt, Sequence[Prompt]], normalize: bool = True) -> list[EmbeddingOutput]:
        """Each prompt's embedding (mean-pooled final-norm hidden states, unit length unless
        ``normalize`` is False; ``LLMEngine.embed``), in prompt order."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return [self.engine.embed(_prompt_input(p), normalize) for p in prompts]

    def stream(self, prompt: Prompt, sampling_params: Optional[SamplingParams] = None,
               request_id: Optional[str] = None) -> Iterator[RequestOutput]:
        """Yield this request's outputs as tokens arrive (``delta_text`` holds the new text).

        Other queued requests keep running in the same batches meanwhile."""
        rid = self.engine.add_request(request_id, _prompt_input(prompt), sampling_params)
        while True:
            for out in self.engine.step():
                if out.request_id == rid:
                    yield out
                    if out.finished:
                        return
            if not self.engine.has_unfinished_requests():
                return

    def abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)

    def _run_to_completion(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(ids)
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="requests", unit="req", disable=not use_tqdm)
        generated = 0
        while pending:
            for out in self.engine.step():
                generated += sum(len(o.delta_token_ids) for o in out.outputs)
                if out.finished and out.request_id in pending:
                    results[out.request_id] = out
                    pending.discard(out.request_id)
                    bar.update(1)
            if use_tqdm:
                elapsed = bar.format_dict.get("elapsed") or 0.0
                if elapsed > 0:
                    bar.set_postfix_str(f"{generated / elapsed:.1f} tok/s", refresh=False)
            if pending and not self.engine.has_unfinished_requests():
                raise RuntimeError(f"engine went idle with requests unfinished: {sorted(pending)}")
        bar.close()
        return [results[i] for i in ids]
