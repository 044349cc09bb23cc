"""Precision of int4 mode's prompt rows through bf16 and int8 copies, on the engine's path (bf16 KV
cache, every position a prompt row) against the fp32 model: the tolerance text and the first
2,048 tokens of the long one.

    python engine_path_precision.py
"""
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from test_precision import _all_position_logits, LONG_TEXT, TEXT
from kvserve.loader import load_model, resolve_model
from kvserve.engine import load_tokenizer
from kvserve.token_roles import ALL_PROMPT, TokenRoles
for name in ["smollm2-135m-instruct", "gemma-3-270m"]:
    src = resolve_model(name)
    for text, n in ((TEXT, 10**6), (LONG_TEXT, 2048)):
        ids = load_tokenizer(src).encode(text)[:n]
        model, config = load_model(src, dtype=torch.float32)
        ref = _all_position_logits(model, config, ids)
        del model
        for fmt in ("bf16", "int8"):
            model, config = load_model(src, dtype=torch.float32, quantization="int4", int4_prefill=fmt)
            lg = _all_position_logits(model, config, ids, kv_dtype=torch.bfloat16, token_roles=TokenRoles(ALL_PROMPT))
            top1 = (lg.argmax(-1) == ref.argmax(-1)).float().mean().item()
            kl = nn.functional.kl_div(lg.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="batchmean").item()
            print(f"{name} n={len(ids)} {fmt} copies: top1 {top1*100:.2f}% err {(lg-ref).abs().mean().item():.3f} KL {kl:.5f}", flush=True)
