"""Pooling a prompt's hidden states into one embedding vector.

kvserve serves generative models, which have no pooling head: as llama.cpp's server does for
them (``--pooling mean``), an embedding is the mean of the prompt's final-norm hidden states
over its positions, scaled to unit length (so that a dot product is the cosine similarity
clients compute).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class EmbeddingOutput:
    prompt_token_ids: list[int]
    embedding: list[float]  # unit length (L2) unless asked otherwise


def mean_pool(hidden: torch.Tensor, normalize: bool = True) -> torch.Tensor:
    """[T, hidden] -> [hidden] float32: the mean over positions, L2-normalised if asked. The
    sum is taken in float64: a long prompt's mean would otherwise depend on summation order
    more than on the model."""
    pooled = hidden.double().mean(dim=0)
    if normalize:
        pooled = pooled / pooled.norm().clamp_min(1e-12)
    return pooled.float()
