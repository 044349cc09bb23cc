"""Routed experts, shared by the MoE architectures (qwen3_moe.py, deepseek_v2.py): the
router's logits and the execution of each token's chosen experts. Which experts a token
chooses, and with which weights, is each architecture's rule (models/routing.py).

Experts run only on the tokens routed to them: the step's (token, expert) pairs are grouped
per expert, and each active expert runs one gate+up and one down matmul on its rows; each
token's weighted results are added in ascending expert order (HF's order). A row's result does
not depend on the other rows (kvserve's fp32 linears reduce each row alone), so batching
leaves it unchanged.

The native decoder runs the same steps in the same order (csrc/decoder.cpp's RoutedExperts, for
Qwen3-MoE's softmax routing): what changes here changes there, and tests/test_fused_decoder.py
holds the two to the same bits.
"""
from __future__ import annotations

import torch
from torch import nn

from kvserve import ops
from kvserve.quant import Fp32Linear
from kvserve.quant.common import batch_invariant_linears
from kvserve.token_roles import roles_of_rows
from kvserve.tracing import label


class MoERouter(nn.Module):
    """The router's logits ``[T, experts]``. Not an ``nn.Linear``, so that weight-format
    conversion leaves it exact: a rounded router would send tokens to other experts.
    ``float32_logits``: computed in float32 whatever the activations' dtype (DeepSeek, as HF)."""

    def __init__(self, hidden_size: int, num_experts: int, float32_logits: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.float32_logits = float32_logits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if self.float32_logits:
            x, w = x.float(), w.float()
        if (w.dtype == x.dtype == torch.float32 and x.device.type == "cpu" and ops.cpu_extension() is not None
                and batch_invariant_linears()):
            return Fp32Linear(w, None)(x)  # (a row's logits independent of the batch)
        return nn.functional.linear(x, w)


def run_routed_experts(x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor,
                       experts: nn.ModuleList) -> torch.Tensor:
    """``sum_j weights[t, j] * experts[expert_ids[t, j]](x[t])`` for every row t of ``x [T,
    hidden]`` (``weights``, ``expert_ids``: ``[T, k]``, a token's ids distinct), each expert
    called once, on its rows only, the k terms added in ascending expert order."""
    with label("experts"):
        top_k = expert_ids.shape[1]
        weights = weights.to(x.dtype)
        # Each token's k choices in ascending expert order: the order their outputs are summed
        # in below (HF's order), whatever their weights.
        expert_ids, order = expert_ids.sort(dim=-1, stable=True)
        weights = weights.gather(1, order)
        flat = expert_ids.reshape(-1)  # (token, choice) pairs, row-major: pair p is token p // k
        pairs = torch.argsort(flat, stable=True)  # grouped by expert, tokens ascending within one
        counts = torch.bincount(flat, minlength=len(experts)).tolist()
        tokens, pair_weights = pairs // top_k, weights.reshape(-1)[pairs]
        # Every pair's weighted expert output lands in its own row (index_copy_: no
        # accumulation, and ~1000x faster on the CPU than index_add_, which measured ~5 ms a
        # call here), then each token's k rows are added in order: row by row, so a row's
        # result does not depend on the others.
        per_pair = x.new_empty(flat.shape[0], x.shape[1])
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue  # an expert no token chose: its weights are never read
            segment = slice(start, start + count)
            rows = tokens[segment]  # (ascending, distinct: a token takes an expert once)
            with roles_of_rows(rows):  # each row keeps its token role (its weight format)
                y = experts[expert](x.index_select(0, rows))
            per_pair.index_copy_(0, pairs[segment], y * pair_weights[segment, None])
            start += count
        per_pair = per_pair.view(x.shape[0], top_k, x.shape[1])
        out = per_pair[:, 0]
        for choice in range(1, top_k):
            out = out + per_pair[:, choice]
        return out
