"""Mixture-of-experts routing: which experts each token takes, with which weights.

Every rule here picks its top k with ties going to the lower index (a stable descending sort,
where ``torch.topk`` leaves ties unspecified), so routing is deterministic and the same in a
batch as alone: a row's choice reads only its own logits. Scores are computed in float32 from
float32 logits, as HF does.

- ``softmax_top_k``: Qwen3-MoE (and DeepSeek V2's ``topk_method="greedy"``): the softmax's
  top k, optionally renormalised.
- ``group_limited_greedy``: DeepSeek V2: the experts are split into ``n_group`` equal groups,
  a group scores its best expert's softmax probability, only the ``topk_group`` best groups
  compete for the k choices.
- ``noaux_tc``: DeepSeek V3: sigmoid scores; the choice reads them plus a per-expert
  correction bias (the auxiliary-loss-free load balancing), a group scores the sum of its two
  best biased scores; the weights are the unbiased scores, optionally renormalised.

DeepSeek's weights are then multiplied by ``routed_scaling_factor``.
"""
from __future__ import annotations

from typing import Optional

import torch

from kvserve import ops
from kvserve.config import ConfigError, ModelConfig

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


def top_k_lowest_index_first(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) ``[T, k]`` of each row's k largest scores, equal scores in ascending
    index order."""
    values, order = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[:, :k], order[:, :k]


def softmax_top_k(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights ``[T, k]`` float32, expert ids ``[T, k]``): the softmax's top k, optionally
    renormalised to sum to 1. fp32 logits on the CPU go through the native kernel
    (csrc/moe_routing.cpp), the one the fused decoder's routed experts call, so that the two
    paths route alike bit for bit; ``softmax_top_k_reference`` is the rule in torch."""
    ext = ops.cpu_extension()
    if ext is not None and logits.dim() == 2 and ops.enabled_for(logits):
        return ext.softmax_top_k(logits, top_k, normalize)
    return softmax_top_k_reference(logits, top_k, normalize)


def softmax_top_k_reference(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax_top_k`` in torch (HF's order of operations)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = top_k_lowest_index_first(probs, top_k)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def _keep_top_groups(choice_scores: torch.Tensor, group_scores: torch.Tensor, topk_group: int,
                     fill: float) -> torch.Tensor:
    """``choice_scores [T, E]`` with every expert outside each row's ``topk_group`` best groups
    (``group_scores [T, G]``) set to ``fill``."""
    num_tokens, num_groups = group_scores.shape
    _, kept = top_k_lowest_index_first(group_scores, topk_group)
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
    per_group = choice_scores.shape[1] // num_groups
    expert_mask = group_mask.unsqueeze(-1).expand(num_tokens, num_groups, per_group).reshape(num_tokens, -1)
    return choice_scores.masked_fill(~expert_mask, fill)


def group_limited_greedy(logits: torch.Tensor, top_k: int, n_group: int,
                         topk_group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek V2's grouped softmax routing (HF's ``DeepseekV2TopkRouter``): the experts of
    the other groups score 0 (below any softmax probability), weights as the softmax gives
    them."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    group_scores = probs.view(probs.shape[0], n_group, -1).amax(dim=-1)
    return top_k_lowest_index_first(_keep_top_groups(probs, group_scores, topk_group, 0.0), top_k)


def noaux_tc(logits: torch.Tensor, correction_bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
             normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek V3's routing (HF's ``DeepseekV3TopkRouter``): experts chosen by sigmoid score
    plus ``correction_bias``, weighted by the sigmoid score alone."""
    scores = logits.float().sigmoid()
    biased = scores + correction_bias.float()
    group_scores = biased.view(biased.shape[0], n_group, -1).topk(2, dim=-1).values.sum(dim=-1)
    _, experts = top_k_lowest_index_first(_keep_top_groups(biased, group_scores, topk_group, float("-inf")), top_k)
    weights = scores.gather(1, experts)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights, experts


def deepseek_route(logits: torch.Tensor, config: ModelConfig,
                   correction_bias: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights ``[T, k]`` float32, expert ids ``[T, k]``) by ``config.topk_method``, the
    weights times ``routed_scaling_factor``.

    V2's rules ignore ``norm_topk_prob``, as HF's DeepseekV2 does (DeepSeek's own V2 code
    renormalises instead of scaling when it is set; every released V2 checkpoint leaves it
    unset, so the two agree on them)."""
    k = config.num_experts_per_tok
    if config.topk_method == "greedy":
        weights, experts = top_k_lowest_index_first(torch.softmax(logits, dim=-1, dtype=torch.float32), k)
    elif config.topk_method == "group_limited_greedy":
        weights, experts = group_limited_greedy(logits, k, config.n_group, config.topk_group)
    else:
        weights, experts = noaux_tc(logits, correction_bias, k, config.n_group, config.topk_group,
                                    config.norm_topk_prob)
    return weights * config.routed_scaling_factor, experts


def check_deepseek_routing(config: ModelConfig) -> None:
    """Raise ConfigError for a routing these rules cannot run."""
    arch, method = config.architecture, config.topk_method
    if method not in TOPK_METHODS:
        raise ConfigError(f"{arch}: unsupported topk_method {method!r} (supported: {', '.join(TOPK_METHODS)})")
    if config.num_experts < 1 or not 1 <= config.num_experts_per_tok <= config.num_experts:
        raise ConfigError(f"{arch}: {config.num_experts_per_tok} experts per token of {config.num_experts}")
    if method != "greedy":
        if config.n_group < 1 or config.num_experts % config.n_group or not 1 <= config.topk_group <= config.n_group:
            raise ConfigError(f"{arch}: {config.num_experts} experts in {config.n_group} groups, "
                              f"{config.topk_group} kept: groups must be equal and topk_group <= n_group")
        per_group = config.num_experts // config.n_group
        if per_group * config.topk_group < config.num_experts_per_tok:
            raise ConfigError(f"{arch}: {config.topk_group} groups of {per_group} experts cannot give "
                              f"{config.num_experts_per_tok} experts per token")
        if method == "noaux_tc" and per_group < 2:
            raise ConfigError(f"{arch}: noaux_tc scores a group by its two best experts: groups of {per_group}")
