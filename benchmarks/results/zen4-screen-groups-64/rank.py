"""benchmarks/screen_rank.py's measure for coarser groups: the rank of the fp32 argmax among the
screen's logits with 4-bit weights per 32/64/128 inputs and activations per as many.

    python rank.py smollm2-135m-instruct,gemma-3-270m
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from screen_rank import head_inputs, min_max_weights, int8_activations, DATA
from kvserve.loader import load_model, resolve_model
from kvserve.engine import load_tokenizer
for name in sys.argv[1].split(","):
    source = resolve_model(name)
    model, config = load_model(source, dtype=torch.float32)
    tok = load_tokenizer(source)
    texts = [tok.encode((DATA / "tolerance_text.txt").read_text()), tok.encode((DATA / "long_text_gpl3.txt").read_text())[:1200]]
    hidden = torch.cat([head_inputs(model, config, ids) for ids in texts])
    weight = getattr(model.lm_head, "exact_weight", model.lm_head.weight).float()
    best = torch.cat([(rows @ weight.T).argmax(-1) for rows in hidden.split(128)])
    for wg, ag in ((32, 32), (64, 64), (128, 128)):
        if weight.shape[1] % wg: continue
        screen = min_max_weights(weight, 4, wg)
        q = int8_activations(hidden, ag)
        ranks = torch.cat([(a > a.gather(1, b[:, None])).sum(-1) for a, b in ((r @ screen.T, b) for r, b in zip(q.split(128), best.split(128)))])
        print(f"{name} 4-bit w/{wg} act/{ag}: max rank {ranks.max().item()}, p99 {ranks.float().quantile(0.99).item():.0f}, >=64: {(ranks >= 64).sum().item()}", flush=True)
