"""``kv_transfer_params``: what a request carries between the two instances, as vLLM names it.

Torch-free. Three shapes, all plain JSON objects:

- to a prefill instance: ``{"do_remote_decode": true}`` (``RemoteDecodeRequest``): compute the
  prompt and its first token, then publish the KV for a decode instance instead of going on;
- back from it, in the response's ``kv_transfer_params`` (``KVTransferParams``): where the KV
  waits and what the decode side needs to continue (the first token, a digest of the prompt,
  the KV layout);
- to the decode instance: that object, unchanged, beside the original request body.

The decode side checks the digest and the layout before admitting the request: a prompt
that tokenized differently or a cache of another shape would otherwise continue from KV
that is not its own.
"""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

from kvserve.request import RequestRejected


def prompt_digest(token_ids: Sequence[int]) -> str:
    """A short, stable name of a token sequence (sha256 of the ids as int64)."""
    return hashlib.sha256(array("q", token_ids).tobytes()).hexdigest()[:32]


@dataclass(frozen=True)
class RemoteDecodeRequest:
    """A prefill instance's instruction: stop after the first token and publish the KV.
    ``max_tokens``: the request's own limit (the engine runs it with 1), so that the prefill
    side knows whether the decode side will go on."""

    max_tokens: Optional[int] = None


@dataclass(frozen=True)
class FirstTokenLogprob:
    token_id: int
    logprob: float
    rank: Optional[int] = None


@dataclass
class KVTransferParams:
    """What a prefill instance hands back for its decode instance.

    ``transfer_id`` is None when nothing was published (the first token already finished the
    request, e.g. EOS or max_tokens 1: the decode side just reports it). ``staged_blocks``:
    the (group, block index) entries published, in their stored order."""

    connector: str
    address: str
    transfer_id: Optional[str]
    first_token_id: int
    num_prompt_tokens: int
    prompt_digest: str
    kv_layout: str
    staged_blocks: list[tuple[int, int]] = field(default_factory=list)
    # The first token's logprobs (sampled token and top alternatives) when they were asked for.
    first_token_logprobs: Optional[list[FirstTokenLogprob]] = None

    def to_json(self) -> dict:
        out = asdict(self)
        out["staged_blocks"] = [list(e) for e in self.staged_blocks]
        return out

    @classmethod
    def from_json(cls, value: Any) -> "KVTransferParams":
        """Parse the decode request's ``kv_transfer_params``; RequestRejected names what is wrong."""
        if not isinstance(value, dict):
            raise RequestRejected("kv_transfer_params must be an object")
        required = {"connector": str, "address": str, "first_token_id": int, "num_prompt_tokens": int,
                    "prompt_digest": str, "kv_layout": str}
        for key, kind in required.items():
            if not isinstance(value.get(key), kind) or isinstance(value.get(key), bool):
                raise RequestRejected(f"kv_transfer_params.{key} is missing or not a {kind.__name__} "
                                      f"(pass the prefill instance's kv_transfer_params unchanged)")
        transfer_id = value.get("transfer_id")
        if transfer_id is not None and not isinstance(transfer_id, str):
            raise RequestRejected("kv_transfer_params.transfer_id must be a string or null")
        staged = value.get("staged_blocks", [])
        if not isinstance(staged, list) or not all(
                isinstance(e, (list, tuple)) and len(e) == 2 and all(isinstance(x, int) and x >= 0 for x in e)
                for e in staged):
            raise RequestRejected("kv_transfer_params.staged_blocks must be a list of [group, index] pairs")
        logprobs = value.get("first_token_logprobs")
        parsed_logprobs = None
        if logprobs is not None:
            try:
                parsed_logprobs = [FirstTokenLogprob(int(e["token_id"]), float(e["logprob"]),
                                                     None if e.get("rank") is None else int(e["rank"]))
                                   for e in logprobs]
            except (TypeError, KeyError, ValueError):
                raise RequestRejected("kv_transfer_params.first_token_logprobs is malformed") from None
        if value["num_prompt_tokens"] < 1:
            raise RequestRejected("kv_transfer_params.num_prompt_tokens must be >= 1")
        return cls(connector=value["connector"], address=value["address"], transfer_id=transfer_id,
                   first_token_id=value["first_token_id"], num_prompt_tokens=value["num_prompt_tokens"],
                   prompt_digest=value["prompt_digest"], kv_layout=value["kv_layout"],
                   staged_blocks=[(int(g), int(i)) for g, i in staged],
                   first_token_logprobs=parsed_logprobs)


def parse_kv_transfer_params(value: Any) -> "RemoteDecodeRequest | KVTransferParams":
    """A request's ``kv_transfer_params``: the prefill instruction or the decode hand-over."""
    if isinstance(value, dict) and value.get("do_remote_decode") is True:
        extra = set(value) - {"do_remote_decode"}
        if extra:
            raise RequestRejected(f"kv_transfer_params: unexpected keys {sorted(extra)} beside do_remote_decode")
        return RemoteDecodeRequest()
    return KVTransferParams.from_json(value)
