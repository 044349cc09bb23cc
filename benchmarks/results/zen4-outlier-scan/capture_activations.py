"""The real inputs of each decoder linear layer (HF transformers' fp32 model on the first 256
tokens of kvserve/bench/texts/summarize.txt, 242 with SmolLM2's tokenizer) beside kvserve's int8
prompt copies of those layers (W8A8Linear), saved for w8a8_ab.py.

    python capture_activations.py smollm2-135m-instruct|gemma-3-270m   # -> /tmp/w8dev/<model>.pt
"""
import os, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from kvserve.loader import load_model, resolve_model
from kvserve.quant import DecodeFormatLinear, W8A8Linear
name = sys.argv[1]
src = resolve_model(name)
hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(src.path), gguf_file=os.path.basename(src.path), dtype=torch.float32)
tok = AutoTokenizer.from_pretrained(os.path.dirname(src.path), gguf_file=os.path.basename(src.path))
text = open(os.path.join(os.path.dirname(__import__("kvserve").__file__), "bench", "texts", "summarize.txt")).read()
ids = tok(text, return_tensors="pt").input_ids[:, :256]
caps = {}
def hook(n):
    def f(mod, inp):
        caps.setdefault(n, inp[0][0].detach().clone())
    return f
for n, m in hf.named_modules():
    if n.endswith(("q_proj", "o_proj", "gate_proj", "down_proj")) and ".layers." in n:
        m.register_forward_pre_hook(hook(n))
with torch.no_grad():
    hf(ids)
model, _ = load_model(src, dtype=torch.float32, quantization="int4", int4_prefill="bf16")
out = []
for n, m in model.named_modules():
    if isinstance(m, DecodeFormatLinear) and ".layers." in n:
        c = m.make_prefill_copy("int8")
        if not isinstance(c, W8A8Linear):
            continue
        key = n.replace("qkv_proj", "q_proj").replace("gate_up_proj", "gate_proj")
        key = "model." + key.split("model.", 1)[-1] if "model." in n else key
        match = [k for k in caps if k.endswith(key.split(".", 1)[-1]) or k == key]
        x = caps[match[0]] if match else None
        out.append(dict(name=n, weight=c.weight, affine=c.affine, bias=c.bias, n=c.out_features, x=x))
print(len(out), "layers;", sum(o["x"] is not None for o in out), "with activations", [o["name"] for o in out[:5]])
os.makedirs("/tmp/w8dev", exist_ok=True)
torch.save(out, f"/tmp/w8dev/{name}.pt")
