"""POST /v1/embeddings: each input's embedding from the served (generative) model, as
llama.cpp's server computes it: the prompt's final-norm hidden states, mean-pooled over its
positions and scaled to unit length (kvserve/pooling.py). The engine thread computes each one
between steps (``AsyncLLMEngine.embed``), in a KV cache of its own: running streams pause for
the length of one prompt's forward, and the scheduler's pool never sees the embedding.
"""
from __future__ import annotations

import base64
import sys
from array import array
from typing import Union

from kvserve.request import RequestRejected
from kvserve.server.errors import bad_request
from kvserve.server.protocol import EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from kvserve.server.serving import ServingContext, check_text


def _inputs(body: EmbeddingRequest) -> list[Union[str, list[int]]]:
    """The request's inputs as a list, each a text or a list of token ids."""
    value = body.input
    if isinstance(value, str):
        return [value]
    if isinstance(value[0], int):
        return [list(value)]
    return list(value)


def encode_base64(vector: list[float]) -> str:
    """The vector as OpenAI sends it with ``encoding_format: "base64"``: little-endian float32
    bytes, base64 (what the openai client decodes with numpy.frombuffer(..., "float32"))."""
    values = array("f", vector)
    if sys.byteorder != "little":
        values.byteswap()
    return base64.b64encode(values.tobytes()).decode("ascii")


async def create_embeddings(ctx: ServingContext, body: EmbeddingRequest) -> EmbeddingResponse:
    ctx.check_model(body.model)
    width = ctx.async_engine.engine.model_config.hidden_size
    if body.dimensions is not None and body.dimensions != width:
        raise bad_request(f"dimensions is {body.dimensions}, but this model's embeddings have "
                          f"{width} (pooled hidden states cannot be shortened)", param="dimensions")
    inputs = _inputs(body)
    for i, item in enumerate(inputs):
        if isinstance(item, str):
            check_text(item, f"input.{i}" if len(inputs) > 1 else "input")
    data: list[EmbeddingData] = []
    num_tokens = 0
    for i, item in enumerate(inputs):
        try:
            output = await ctx.async_engine.embed(item)
        except RequestRejected as exc:
            where = f"input[{i}]: " if len(inputs) > 1 else ""
            raise bad_request(where + str(exc), param="input") from None
        num_tokens += len(output.prompt_token_ids)
        vector = output.embedding
        data.append(EmbeddingData(index=i, embedding=encode_base64(vector)
                                  if body.encoding_format == "base64" else vector))
    return EmbeddingResponse(data=data, model=ctx.model_name,
                             usage=EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens))
