"""When a request is finished: the token-level rules, applied one token at a time.

Torch-free. The scheduler is the one owner of "finished": after it appends each new token
(several arrive in one step when speculation is accepted) it asks, in this order, the text
rule (a stop string, decided by the detokenizer through a callback) and then these token
rules. The first rule that fires ends the request at that token; tokens after it in the
same step are dropped.
"""
from __future__ import annotations

from typing import Optional

from kvserve.request import Request, RequestStatus


def check_token_stop(request: Request, max_model_len: int) -> Optional[RequestStatus]:
    """Stop token / EOS (after ``min_tokens``), ``max_tokens``, or the context length, judged
    on the request's newest token. Sets ``stop_reason`` for a stop token."""
    params = request.sampling_params
    token = request.output_token_ids[-1]
    if request.num_output_tokens >= params.min_tokens:
        if (not params.ignore_eos and token in request.eos_token_ids) or token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
    if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    if request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def max_new_tokens(request: Request, max_model_len: int) -> int:
    """How many more tokens the request may append before a length rule ends it."""
    left = max_model_len - request.num_tokens
    max_tokens = request.sampling_params.max_tokens
    if max_tokens is not None:
        left = min(left, max_tokens - request.num_output_tokens)
    return left
