"""int8 activations (per G inputs, R exact outliers) against the file's exact weights, in plain
torch: hooks round the inputs of the fp32 model's decoder linear layers (the fused decoder off).

    python activation_rounding_sim.py smollm2-135m-instruct,gemma-3-270m 64/4,32/4,16/0
"""
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))
from test_precision import _all_position_logits, TEXT, LONG_TEXT
from kvserve.loader import load_model, resolve_model
from kvserve.engine import load_tokenizer
torch.set_num_threads(2)

def qact(x, G, R):
    shape = x.shape; x = x.reshape(-1, shape[-1]).clone()
    K = x.shape[-1]
    if R:
        idx = x.abs().topk(R, dim=-1).indices
        keep = torch.gather(x, -1, idx)
        x.scatter_(-1, idx, 0.)
    Kp = -(-K // G) * G
    xp = torch.nn.functional.pad(x, (0, Kp - K)).view(x.shape[0], -1, G)
    s = xp.abs().amax(-1, keepdim=True) / 127
    q = torch.where(s > 0, torch.round(xp / torch.where(s > 0, s, 1)), 0) * s
    y = q.view(x.shape[0], Kp)[:, :K]
    if R: y.scatter_(-1, idx, keep)
    return y.view(shape)

def run(name, G, R, text, n_tok):
    src = resolve_model(name)
    ids = load_tokenizer(src).encode(text)[:n_tok]
    model, config = load_model(src, dtype=torch.float32)
    model.model.fused_layers = None
    ref = _all_position_logits(model, config, ids)
    hooks = []
    model.model.fused_layers = None
    if G:
        for mname, mod in model.named_modules():
            if mname.split(".")[-1] in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                hooks.append(mod.register_forward_pre_hook(lambda m, a: (qact(a[0], G, R),)))
    lg = _all_position_logits(model, config, ids)
    for h in hooks: h.remove()
    top1 = (lg.argmax(-1) == ref.argmax(-1)).float().mean().item()
    kl = nn.functional.kl_div(lg.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="batchmean").item()
    err = (lg - ref).abs().mean().item()
    print(f"{name} G={G} R={R} n={len(ids)} top1={top1*100:.2f}% err={err:.3f} KL={kl:.5f}", flush=True)

for name in sys.argv[1].split(","):
    for spec in sys.argv[2].split(","):
        G, R = map(int, spec.split("/"))
        run(name, G, R, TEXT, 10**6)
        run(name, G, R, LONG_TEXT, 2048)
