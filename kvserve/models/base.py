"""What every kvserve causal LM shares: the runner-facing forward and weight loading.

Subclasses build ``self.model`` (``embed_tokens``, ``layers``, ``norm``, returning pre-norm
hidden states) and ``self.lm_head``, and declare their fused projections in
``packed_modules``: fused name -> the upstream (HF) names it concatenates, in row order.
"""
from __future__ import annotations

from typing import Any, ClassVar, Iterable, Optional

import torch
from torch import nn

from kvserve.attention import AttentionMetadata
from kvserve.kv_cache import KVCache
from kvserve.config import ConfigError, ModelConfig
from kvserve.distributed import ParallelGroup, PipelineStage
from kvserve.models.spec import LLAMA_LAYER, DecoderLayerSpec
from kvserve.quant import RescoredLMHead
from kvserve.token_roles import TokenRoles, use_token_roles


def last_layer_rows(logits_indices: torch.Tensor, num_rows: int) -> tuple[Optional[torch.Tensor], torch.Tensor]:
    """(rows, gather): the rows of a step of ``num_rows`` that its last decoder layer computes
    past attention (sorted and distinct; None: every row), and the rows of the decoder's output
    that are ``logits_indices``' (which may repeat rows or come in any order).

    Past the last layer's attention a row only feeds its own logits: its keys and values are in
    the cache by then, and the later rows read those, not its hidden state. So a prompt chunk's
    rows without logits skip that layer's output projection and MLP (llama.cpp skips them as
    well): ~1/30 of SmolLM2's prefill, ~1/18 of Gemma 3's. The kernels reduce each row alone, so
    the rows that are computed keep their bits."""
    if logits_indices.numel() >= num_rows:
        return None, logits_indices
    rows, gather = torch.unique(logits_indices, sorted=True, return_inverse=True)
    return rows, gather


class PagedCausalLM(nn.Module):
    packed_modules: ClassVar[dict[str, tuple[str, ...]]] = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }

    # The architecture's decoder layer as the native decoder reads it (models/spec.py).
    layer_spec: ClassVar[DecoderLayerSpec] = LLAMA_LAYER

    config: ModelConfig
    model: nn.Module
    lm_head: nn.Linear
    # Tensor parallelism (models/tensor_parallel.py): the LM head holds one vocabulary shard
    # and the logits are gathered from every rank; None on a single process.
    tp: Optional[ParallelGroup] = None
    # Pipeline parallelism: this stage's layers only; only the last stage computes logits.
    pp: Optional[PipelineStage] = None

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64, tokens of several sequences flattened
        positions: torch.Tensor,  # [T] int64
        attn_metadata: AttentionMetadata,
        kv_caches: KVCache,  # every layer's paged KV (kvserve.kv_cache)
        logits_indices: torch.Tensor,  # [S'] int64 rows of T whose logits are wanted
        token_roles: Optional[TokenRoles] = None,  # which rows are prompt tokens (dual-format linears)
        argmax_only: bool = False,  # the caller reads only each row's argmax (see RescoredLMHead)
        transient_logits: bool = False,  # the caller is done with the logits before its next call
        argmax_tokens: bool = False,  # with argmax_only: return each row's argmax where the head gives it
    ) -> Optional[torch.Tensor]:
        """[S', vocab] float32 logits; with ``argmax_tokens``, where the LM head takes the argmax
        itself (RescoredLMHead.argmax_tokens: no vocabulary-wide rows are written), each row's
        argmax token instead, int64 [S'] (tell them apart by dtype); None on a pipeline stage
        before the last."""
        # The roles choose the decoder layers' weight format per row; the LM head, after the
        # block, computes every row alike.
        # A stage before the last sends every row on: only the model's last layer selects rows.
        last_stage = self.pp is None or self.pp.is_last
        rows, gather = last_layer_rows(logits_indices, input_ids.shape[0]) if last_stage else (None, logits_indices)
        with use_token_roles(token_roles):
            hidden = self.model(input_ids, positions, attn_metadata, kv_caches, rows)
        if not last_stage:
            return None  # the hidden states went to the next stage
        # (gather indexes the decoder's rows: a decoder that returned every row would be misread)
        assert hidden.shape[0] == (input_ids.shape[0] if rows is None else rows.numel()), "decoder ignored output_rows"
        # Only the rows that will be sampled reach the final norm and the (vocab-wide) head.
        hidden = self.model.norm(hidden.index_select(0, gather))
        if (argmax_tokens and argmax_only and isinstance(self.lm_head, RescoredLMHead) and self.tp is None
                and not self.config.final_logit_softcapping):  # (a cap's tanh can tie logits: argmax over capped rows)
            tokens = self.lm_head.argmax_tokens(hidden)
            if tokens is not None:
                return tokens
        if isinstance(self.lm_head, RescoredLMHead):
            # (Transient logits may live in memory the head keeps: a fresh [rows, vocabulary]
            # tensor past glibc's mmap threshold is page-faulted in at every step.)
            logits = self.lm_head(hidden, argmax_only=argmax_only, transient=transient_logits)
        else:
            logits = self.lm_head(hidden).float()
        if self.tp is not None and logits.shape[0]:
            logits = self.tp.all_gather_last_dim(logits)[:, :self.config.vocab_size]
        cap: Optional[float] = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def hidden_states(
        self,
        input_ids: torch.Tensor,  # [T] int64: one sequence's tokens (a chunk of its prompt)
        positions: torch.Tensor,  # [T] int64
        attn_metadata: AttentionMetadata,
        kv_caches: KVCache,
        token_roles: Optional[TokenRoles] = None,
    ) -> torch.Tensor:
        """[T, hidden] final-norm hidden states of every row: what the LM head would read, for
        pooling (embeddings). The same decoder call as ``forward``, with every row kept through
        the last layer (no logits rows to select) and no head. A single process only: a
        parallel model's hidden states are split over its ranks or stages."""
        if self.tp is not None or self.pp is not None:
            raise NotImplementedError("hidden states of a tensor- or pipeline-parallel model")
        with use_token_roles(token_roles):
            hidden = self.model(input_ids, positions, attn_metadata, kv_caches, None)
        return self.model.norm(hidden)

    def decode_round(self, num_steps: int, input_ids: torch.Tensor, positions: torch.Tensor,
                     attn_metadata: AttentionMetadata, kv_caches: KVCache, block_size: int) -> Optional[torch.Tensor]:
        """``num_steps`` greedy, argmax-only decode steps in one native call
        (FusedDecoderLayers.decode_round: the calls forward makes per step, in its order): the
        tokens ``[num_steps, rows]``. The first step runs on the inputs as given; each later one
        feeds back the tokens before it, advancing ``input_ids``, ``positions`` and the
        metadata's slot mappings and ``seq_lens_tensor`` in place. None where forward would not
        run on the fused layers and the head's one-call screen (the caller steps in Python)."""
        fused = getattr(self.model, "fused_layers", None)
        head, norm = self.lm_head, self.model.norm
        if (fused is None or self.tp is not None or self.pp is not None or self.config.final_logit_softcapping
                or not isinstance(head, RescoredLMHead) or norm.weight.dtype != torch.float32
                or not fused.applies_to(self.model.embed_tokens, kv_caches)):
            return None
        screen_call = head.native_screen(input_ids.shape[0], norm.weight)  # (an fp32 tensor on the device)
        if screen_call is None:
            return None
        fused_inputs = self.model.fused_inputs(attn_metadata.max_seq_len + num_steps, input_ids.device)
        return fused.decode_round(num_steps, input_ids, positions, block_size, fused_inputs,
                                  attn_metadata, kv_caches, norm, screen_call)

    @classmethod
    def adapt_hf_config(cls, hf_config: dict[str, Any], config: ModelConfig) -> None:
        """The architecture's part of the HF ``config.json`` -> ``ModelConfig`` mapping, on
        the fields loader/safetensors.py filled generically (in place; raise ConfigError for
        what the architecture cannot run)."""

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _packed_target(self, name: str) -> tuple[str, int, int]:
        """(parameter name, shard index, shard count) for an upstream weight name."""
        for fused, parts in self.packed_modules.items():
            for i, part in enumerate(parts):
                if f".{part}." in name:
                    return name.replace(f".{part}.", f".{fused}."), i, len(parts)
        return name, 0, 1

    def _assign(self, name: str, tensor: torch.Tensor) -> None:
        module_name, attr = name.rsplit(".", 1)
        module = self.get_submodule(module_name)
        expected = getattr(module, attr).shape
        if tuple(tensor.shape) != tuple(expected):
            raise ConfigError(f"weight '{name}' has shape {tuple(tensor.shape)}, the model expects {tuple(expected)}")
        setattr(module, attr, nn.Parameter(tensor, requires_grad=False))

    def is_unused_checkpoint_weight(self, name: str) -> bool:
        """Whether a checkpoint tensor belongs to something the model does not run (DeepSeek
        V3's multi-token-prediction layer): skipped at load instead of refused."""
        return False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Assign upstream-named weights (already on the target device/dtype), concatenating
        the shards of fused projections. Every parameter must be covered exactly."""
        params = {name for name, _ in self.named_parameters()}
        if self.config.tie_word_embeddings:
            params.discard("lm_head.weight")
        shards: dict[str, dict[int, torch.Tensor]] = {}
        loaded: set[str] = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # some checkpoints store the tied copy too
            if self.is_unused_checkpoint_weight(name):
                continue
            target, index, count = self._packed_target(name)
            if target not in params:
                raise ConfigError(f"unexpected weight '{name}' for {type(self).__name__}")
            if count == 1:
                self._assign(target, tensor)
                loaded.add(target)
                continue
            parts = shards.setdefault(target, {})
            parts[index] = tensor
            if len(parts) == count:
                self._assign(target, torch.cat([parts[i] for i in range(count)], dim=0))
                loaded.add(target)
                del shards[target]
        missing = sorted(params - loaded)
        if missing:
            raise ConfigError(f"checkpoint lacks {len(missing)} weight(s), e.g. '{missing[0]}'")
        self.tie_weights()
