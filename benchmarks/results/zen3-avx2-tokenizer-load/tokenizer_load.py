"""A converted GGUF tokenizer's load: AutoTokenizer (the class its config names) against
kvserve.tokenizer._load_converted_dir (a generic fast tokenizer over tokenizer.json), each in a
fresh process (so nothing is memoised), alternated. transformers is imported before the clock.

    python tokenizer_load.py [rounds]
"""
import subprocess
import sys

CHILD = r"""
import sys, time
from pathlib import Path
import transformers
from transformers import AutoTokenizer
from kvserve.engine import resolve_model
from kvserve.tokenizer import DEFAULT_CACHE_DIR, Tokenizer, _gguf_cache_key, _load_converted_dir
model, way = sys.argv[1], sys.argv[2]
path = Path(resolve_model(model).path).resolve()
Tokenizer.from_gguf(str(path)) if not (DEFAULT_CACHE_DIR / _gguf_cache_key(path)).is_dir() else None
directory = DEFAULT_CACHE_DIR / _gguf_cache_key(path)
t = time.perf_counter()
tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True) if way == "auto" else _load_converted_dir(directory)
print(f"{model:24s} {way:10s} {time.perf_counter() - t:6.2f} s  {type(tok).__name__}")
"""

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
for _ in range(rounds):
    for model in ("gemma-3-270m", "smollm2-135m-instruct"):
        for way in ("auto", "converted"):
            subprocess.run([sys.executable, "-c", CHILD, model, way], check=True)
