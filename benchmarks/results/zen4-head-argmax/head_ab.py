"""The LM head of an argmax-only step at B rows: argmax-only logits + ops.argmax (the runner's
path before) against argmax_tokens, alternated in one process, with a 128 MB read between calls
so that the weights come from memory as in a step."""
import statistics, sys, time
import torch
from kvserve import ops
from kvserve.loader import load_model, resolve_model
model_name, rows = sys.argv[1], int(sys.argv[2])
model, config = load_model(resolve_model(model_name), dtype=torch.float32, quantization="bf16")
head = model.lm_head
x = torch.randn(rows, config.hidden_size)
evict = torch.ones(32 * 2**20)
t = {"logits + argmax": [], "argmax_tokens": []}
with torch.inference_mode():
    assert torch.equal(ops.argmax(head(x, argmax_only=True)), head.argmax_tokens(x))
    for i in range(30):
        for mode in (list(t) if i % 2 == 0 else list(t)[::-1]):
            evict.sum()
            s = time.perf_counter()
            if mode == "argmax_tokens":
                head.argmax_tokens(x)
            else:
                ops.argmax(head(x, argmax_only=True, transient=True))
            t[mode].append((time.perf_counter() - s) * 1e3)
print(f"{model_name}, {rows} rows, {torch.get_num_threads()} threads:")
for m, v in t.items():
    print(f"  {m}: median {statistics.median(v):.2f} ms, min {min(v):.2f}")
