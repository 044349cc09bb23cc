"""The LM head: a low-precision head whose top candidates are rescored in fp32, and the 4-bit
screen that ranks the vocabulary for argmax-only steps."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from kvserve import ops
from kvserve.config import ConfigError
from kvserve.quant.common import _packed_by_kernel
from kvserve.quant.nibbles import quantize_min_max, tile_nibbles, untile_nibbles
from kvserve.row_table import RowSource, gathered_rows_dot, table_args

# The low-precision LM head's top candidates are rescored with the fp32 weights so that
# greedy picks and top logprobs carry fp32 precision (bf16 logits have ~3 significant digits).
LM_HEAD_RESCORE_TOP_K = 16
# A step that needs only each row's argmax (kvserve.sampler.argmax_suffices) ranks the
# vocabulary with the head's 4-bit screen and rescores this many candidates in fp32. On the
# real models' texts the fp32 argmax ranked at most 12th in the screen (1,512 positions,
# benchmarks/results/zen4-screen-groups-64): 64 leaves a margin, and rescoring 64 rows costs
# microseconds.
SCREEN_TOP_K = 64
SCREEN_GROUP = 64  # inputs per group of the screen's weights and activations (csrc/screen_linear.cpp kGroup)


def screen_activations(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The screen kernel's activations: each group (last dimension, 64 inputs) rounded to
    integers in -127..127 against its largest magnitude, as the kernel computes them
    (``x * (1 / scale)``, ties to even; a NaN input ignored by the maximum, and a NaN or inf
    input's integer 0); (the integers, the groups' scales)."""
    inf = float("inf")
    scale = groups.nan_to_num(nan=0.0, posinf=inf, neginf=-inf).abs().amax(-1) / 127.0
    inv = torch.where(scale > 0, torch.full_like(scale, 1.0) / torch.where(scale > 0, scale, 1.0), 0.0)
    scaled = groups * inv[..., None]
    return torch.where(scaled.isfinite(), torch.round(scaled).clamp(-127, 127), 0.0), scale


class Q4Screen(nn.Module):
    """Approximate logits for ranking only: the weights at 4 bits (asymmetric min/max per group
    of 64, ``d`` and ``m`` fp16: 0.5625 bytes a weight, against Q8_0's 1.06) times activations
    rounded to int8 per group of 64, summed as integers (kvserve/csrc/screen_linear.cpp).

    Too coarse for logits (SmolLM2's head: mean error 0.4 against fp32) but a good ranking:
    the fp32 argmax ranked at most 12th on the real models' texts (benchmarks/screen_rank.py).
    ``packed``: uint8 ``[ceil(N / 16), K / 64, 576]``, per tile of 16 rows and group of 64
    inputs two blocks of nibbles in ``tile_nibbles``' layout (inputs 0-31, then 32-63), then the
    16 rows' ``d``, then their ``m``, as fp16.
    """

    def __init__(self, packed: torch.Tensor, out_features: int) -> None:
        super().__init__()
        self.register_buffer("packed", packed.contiguous())
        self.out_features, self.in_features = out_features, packed.shape[1] * SCREEN_GROUP

    @classmethod
    def from_float(cls, weight: torch.Tensor) -> "Q4Screen":
        n, k = weight.shape
        if k % SCREEN_GROUP:
            raise ConfigError(f"the 4-bit screen needs in_features divisible by {SCREEN_GROUP}, got {k}")
        packed = _packed_by_kernel("q4_screen_pack", weight)  # (the torch ops take seconds for Gemma 3's head)
        return cls(packed if packed is not None else cls.pack_reference(weight), n)

    @staticmethod
    def pack_reference(weight: torch.Tensor) -> torch.Tensor:
        """``packed`` for ``weight`` [N, K] in plain torch (the extension's q4_screen_pack)."""
        k = weight.shape[1]
        q, d, m = quantize_min_max(weight, 4, SCREEN_GROUP)
        # tile_nibbles' 32-input groups, each carrying its 64-group's d and m: keep both blocks'
        # nibbles and the first one's scales.
        halves = tile_nibbles(q, d.repeat_interleave(2, dim=1), m.repeat_interleave(2, dim=1))
        halves = halves.view(halves.shape[0], k // SCREEN_GROUP, 2, -1)
        return torch.cat([halves[:, :, 0, :256], halves[:, :, 1, :256], halves[:, :, 0, 256:]], dim=-1)

    def _blocks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q ``[N, K]`` in 0..15, d, m ``[N, K / 64]``) from ``packed``."""
        p = self.packed
        scales = p[:, :, 512:]
        halves = torch.stack([torch.cat([p[:, :, :256], scales], -1), torch.cat([p[:, :, 256:512], scales], -1)], 2)
        values, d, m = untile_nibbles(halves.view(p.shape[0], -1, 320), self.out_features)
        return values, d[:, ::2], m[:, ::2]

    def forward(self, x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Approximate logits ``[rows, N]``, written into ``out`` (float32, that shape) when given."""
        rows = x.reshape(-1, self.in_features).float().contiguous()
        ext = ops.cpu_extension()
        if ext is not None and rows.device.type == "cpu":
            if out is None:
                return ext.q4_screen_linear(rows, self.packed, self.out_features)
            ext.q4_screen_linear_out(out, rows, self.packed)
            return out
        y = self.forward_reference(rows)
        return y if out is None else out.copy_(y)

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """The kernel's arithmetic in plain torch (other summation order)."""
        groups = self.packed.shape[1]
        values, d, m = self._blocks()
        q = values.view(self.out_features, groups, SCREEN_GROUP).float()
        scales = torch.stack([d, m])
        xg = x.float().view(x.shape[0], groups, SCREEN_GROUP)
        xq, dx = screen_activations(xg)
        dots = torch.einsum("sgj,ngj->sng", xq, q)
        return (dots * scales[0][None] * dx[:, None]).sum(-1) + xg.sum(-1) @ scales[1].T


class RescoredLMHead(nn.Module):
    """A low-precision LM head whose top candidates are recomputed with the fp32 weights.

    The cheap head ranks the whole vocabulary; the ``top_k`` best of each row get exact fp32
    logits (a [rows, top_k, hidden] gather and one batched dot product), so argmax and the top
    logprobs match an fp32 head unless the true best token fell outside the top k.

    With a ``screen`` (Q4Screen), a step that needs only each row's argmax (``argmax_only``:
    greedy rows that ask for nothing else) ranks with the screen instead, in about half the
    bytes, and its ``SCREEN_TOP_K`` best get fp32 logits; every other logit is -inf, so the
    argmax is the fp32 argmax unless the true best ranked below the candidates.
    """

    def __init__(self, fast: nn.Module, exact_weight: RowSource, top_k: int = LM_HEAD_RESCORE_TOP_K,
                 screen: Optional[Q4Screen] = None) -> None:
        super().__init__()
        self.fast = fast
        # fp32 [vocab, hidden], or the Q8Table of its blocks (kvserve.row_table); shared with the
        # embedding table when tied.
        self.exact_weight = exact_weight
        self.top_k = top_k
        self.screen = screen
        self._kept_logits: Optional[torch.Tensor] = None  # see _kept_buffer

    def native_screen(self, rows: int, x: torch.Tensor) -> Optional[tuple]:
        """(logits buffer, screen weights, exact weights, their Q8_0 scales or None, top_k): the
        arguments of forward's one-call argmax path (``screened_logits_out``) for ``rows`` rows
        like ``x`` (fp32, on x's device), or None where forward takes another path."""
        exact, exact_scales = table_args(self.exact_weight)
        if (self.screen is None or not rows or not ops.enabled_for(x)
                or (exact_scales is None and exact.dtype != torch.float32) or not exact.is_contiguous()):
            return None
        out = self._kept_buffer(rows, self.screen.out_features, x)
        return out, self.screen.packed, exact, exact_scales, min(SCREEN_TOP_K, out.shape[-1])

    def argmax_tokens(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """Each row's argmax of ``self(x, argmax_only=True)`` as int64 ``[rows]`` (the token
        ``ops.argmax`` takes from those logits), without writing the rows of -inf around the
        candidates (``screened_argmax_out``); None where ``forward`` would not take the native
        screen."""
        call = self.native_screen(x.shape[0], x) if x.dim() == 2 and x.is_contiguous() else None
        if call is None:
            return None
        tokens = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
        ops.cpu_extension().screened_argmax_out(tokens, call[0], x, *call[1:])
        return tokens

    def _kept_buffer(self, rows: int, columns: int, x: torch.Tensor) -> torch.Tensor:
        """The transient logits' memory, kept from call to call and grown as needed: what a
        transient call returns is valid until the next one (the runner samples from it in the
        same step). A fresh tensor this size (Gemma 3: 1 MB per row) comes from mmap once past
        glibc's 32 MB threshold, and its first touch faulted ~8 ms into a 32-row decode step."""
        buf = self._kept_logits
        if (buf is None or buf.shape[0] < rows or buf.shape[1] != columns or buf.device != x.device
                or buf.is_inference() != torch.is_inference_mode_enabled()):
            capacity = max(rows, 0 if buf is None or buf.shape[1] != columns else buf.shape[0])
            buf = self._kept_logits = torch.empty(capacity, columns, dtype=torch.float32, device=x.device)
        return buf[:rows]

    def _full_logits(self, x: torch.Tensor, transient: bool) -> torch.Tensor:
        """The fast head's logits of every token, into the kept buffer when ``transient`` and
        the fast head writes into one (kvserve's bf16 and Q8 kernels)."""
        forward_into = getattr(self.fast, "forward_into", None)
        if transient and forward_into is not None:
            logits = forward_into(x, lambda rows: self._kept_buffer(rows, self.fast.out_features, x))
            if logits is not None:
                return logits
        return self.fast(x).float()

    def forward(self, x: torch.Tensor, argmax_only: bool = False, transient: bool = False) -> torch.Tensor:
        """Logits ``[rows, vocabulary]``. ``argmax_only``: the caller reads only each row's argmax
        (the screen ranks; see the class). ``transient`` (implied by ``argmax_only``): the caller
        is done with the result before its next call here, which may write into the same memory."""
        screened = argmax_only and self.screen is not None
        if screened:
            rows = x.numel() // x.shape[-1]
            call = self.native_screen(rows, x) if x.dim() == 2 and x.is_contiguous() else None
            if call is not None:
                # The same kernels as below, in one native call (see screened_logits_out).
                ops.cpu_extension().screened_logits_out(call[0], x, *call[1:])
                return call[0]
            out = self._kept_buffer(rows, self.screen.out_features, x)
            top_k = min(SCREEN_TOP_K, out.shape[-1])
            logits = self.screen(x, out=out)
        else:
            logits, top_k = self._full_logits(x, transient or argmax_only), self.top_k
        if logits.shape[0] == 0:
            return logits
        idx = ops.top_k(logits, min(top_k, logits.shape[-1]))[1]  # [S, k]
        exact = gathered_rows_dot(x.float(), self.exact_weight, idx)
        if screened:
            logits.fill_(float("-inf"))
        return logits.scatter_(1, idx, exact)
