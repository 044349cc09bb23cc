# Gemma 3's Q5_0 shapes (gate_up 4096 x 640, qkv 1280 x 640; 12 layers each), one activation row:
# the 5-bit tiles (Q5Linear) against the same weights as Q8_0 bytes (how AVX2 loaded Q5_0 before).
# Usage: python q5_ab.py THREADS (from the repository root: it imports tests/test_block_formats).
import sys, time, torch, numpy as np
sys.path.insert(0, "tests")
from kvserve import ops, block_formats
from kvserve.quant import Q5Linear, Q8Linear
from test_block_formats import random_blocks
from gguf import GGMLQuantizationType as T
torch.set_num_threads(int(sys.argv[1]))
ext = ops.load_extension()
layers = []
for i in range(12):
    for n, k in ((4096, 640), (1280, 640)):
        data = random_blocks(T.Q5_0, n, k, seed=i)
        blocks = block_formats.unpack("Q5_0", data, (n, k))
        q5 = Q5Linear(blocks, k, None)
        codes = block_formats.q5_codes(blocks).astype(np.int8).reshape(n, -1)[:, :k]  # q - 16 in a byte
        q8 = Q8Linear.from_byte_blocks(block_formats.ByteBlocks(codes, np.ascontiguousarray(blocks.d[:, :k // 32])), None)
        layers.append((q5, q8))
q5, q8 = layers[0]
x = torch.randn(1, 640)
ref = x.double() @ q5.dequantized().double().T
print("packed", q5.packed is not None, "rel err q5 %.2e q8 %.2e" % ((q5(x) - ref).norm() / ref.norm(), (q8(x) - ref).norm() / ref.norm()))
best = {"q5 tiles": 1e9, "q8": 1e9}
for _ in range(15):
    for name, idx in (("q5 tiles", 0), ("q8", 1)):
        t = time.perf_counter()
        for pair in layers: pair[idx].forward_blocks(x)
        best[name] = min(best[name], time.perf_counter() - t)
print(torch.get_num_threads(), {k: "%.2f ms" % (v * 1e3) for k, v in best.items()}, "q8/q5 %.2fx" % (best["q8"] / best["q5 tiles"]))
