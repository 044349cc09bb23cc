"""The engines kvserve is compared with, by name, as ``--compare`` spells them.

    hf            = hf-fp32-seq, hf-fp32-batch     (HF transformers generate)
    hf-bf16       = hf-bf16-seq, hf-bf16-batch
    llamacpp      = llamacpp-seq, llamacpp-batch   (llama-cpp-python, optional extra: the
                    llamacpp-q4_0-seq, -batch       shipped GGUF, and the same weights
                                                    requantized to Q4_0, llama.cpp's fastest)
    openvino      = openvino-int4                  (OpenVINO GenAI's ContinuousBatchingPipeline,
    openvino-int8                                   optional venv: scripts/setup_openvino.sh;
                                                    the same weights exported by optimum-cli)
    kvserve-noprefix                               (kvserve with prefix caching off)
    kvserve-nospec, kvserve-ngram                  (kvserve with speculation off / n-gram on)
    kvserve-draft                                  (kvserve drafting with the model's own int4 weights)
    kvserve-kv-int8, kvserve-kv-bfloat16, ...      (kvserve with that KV cache dtype)
    kvserve-int4, kvserve-int8, kvserve-bf16,      (kvserve with that linear weight format,
    kvserve-fp32                                    --quantization; fp32: none)
    kvserve-blas                                   (kvserve's opt-out of determinism:
                                                    KernelConfig(batch_invariant=False), oneDNN/MKL linears)
    kvserve-noreclaim                              (sliding-window layers keep the whole context)

Every peer has ``warmup()``, ``run(workload, progress) -> EngineRun`` and ``close()``. A peer
that cannot run here (package absent, no GGUF file) is skipped with the reason.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

import torch

from kvserve.config import ConfigError, EngineArgs, parse_kernel_config

ALIASES = {
    "hf": ["hf-fp32-seq", "hf-fp32-batch"],
    "hf-fp32": ["hf-fp32-seq", "hf-fp32-batch"],
    "hf-bf16": ["hf-bf16-seq", "hf-bf16-batch"],
    "hf-seq": ["hf-fp32-seq"],
    "hf-batch": ["hf-fp32-batch"],
    # The shipped file and llama.cpp's fastest CPU format (the same weights requantized to Q4_0).
    "llamacpp": ["llamacpp-seq", "llamacpp-batch", "llamacpp-q4_0-seq", "llamacpp-q4_0-batch"],
    "llama.cpp": ["llamacpp-seq", "llamacpp-batch", "llamacpp-q4_0-seq", "llamacpp-q4_0-batch"],
    "llamacpp-file": ["llamacpp-seq", "llamacpp-batch"],
    "llamacpp-q4_0": ["llamacpp-q4_0-seq", "llamacpp-q4_0-batch"],
    # Issue 63's setting: int4, symmetric, a scale per 64 weights.
    "openvino": ["openvino-int4"],
}
PEER_NAMES = ["hf-fp32-seq", "hf-fp32-batch", "hf-bf16-seq", "hf-bf16-batch",
              "llamacpp-seq", "llamacpp-batch", "llamacpp-q4_0-seq", "llamacpp-q4_0-batch",
              "openvino-int4", "openvino-int8", "kvserve-noprefix",
              "kvserve-nospec", "kvserve-ngram", "kvserve-draft", "kvserve-kv-int8", "kvserve-kv-bfloat16",
              "kvserve-kv-float32", "kvserve-blas", "kvserve-noreclaim",
              "kvserve-int4", "kvserve-int8", "kvserve-bf16", "kvserve-fp32"]
# The weight-format peers: --quantization of each.
_WEIGHT_FORMAT_PEERS = {"kvserve-int4": "int4", "kvserve-int8": "int8", "kvserve-bf16": "bf16",
                        "kvserve-fp32": "none"}
# Speculation of the kvserve-ngram peer: vLLM's defaults shape, k = 4.
NGRAM_PEER_CONFIG = {"method": "ngram", "num_speculative_tokens": 4}
# The kvserve-draft peer: the target model drafting for itself with int4 weights (SmolLM2's
# Q4_1 blocks), k = 4.
DRAFT_PEER_CONFIG = {"method": "draft_model", "quantization": "int4", "num_speculative_tokens": 4}
_HF_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class PeerUnavailable(Exception):
    """This peer cannot run here; the message says why."""


def expand_peer_names(spec: Optional[str], sequential_only: bool = False) -> list[str]:
    """``"hf,llamacpp"`` -> concrete peer names, in order, without duplicates. A single
    stream has nothing to batch, so ``sequential_only`` drops the batched modes of aliases."""
    names: list[str] = []
    for item in (spec or "").split(","):
        item = item.strip().lower()
        if not item:
            continue
        expanded = ALIASES.get(item, [item])
        if sequential_only and item in ALIASES:
            expanded = [n for n in expanded if not n.endswith("-batch")]
        for name in expanded:
            if name not in PEER_NAMES:
                raise ConfigError(f"unknown peer {item!r}; choose from "
                                  f"{', '.join(list(ALIASES) + PEER_NAMES)}")
            if name not in names:
                names.append(name)
    return names


@dataclass
class PeerContext:
    """What peers need to run the same model as kvserve: its source, the thread count and
    the engine arguments; loaded HF models are shared between a dtype's two modes."""

    source_kind: str  # "gguf" | "hf_dir" | anything else (e.g. a random-weight test model)
    source_path: str
    num_threads: int
    eargs: EngineArgs
    hf_batch_size: Optional[int] = None  # None: the whole workload in one static batch
    _hf_models: dict = field(default_factory=dict)

    def hf_model(self, dtype_name: str):
        if self.source_kind not in ("gguf", "hf_dir"):
            raise PeerUnavailable(f"HF transformers needs a GGUF file or an HF directory, "
                                  f"not a {self.source_kind} model")
        if dtype_name not in self._hf_models:
            from kvserve.bench.hf_peer import load_hf_model
            self._hf_models[dtype_name] = load_hf_model(self.source_path, self.source_kind,
                                                        _HF_DTYPES[dtype_name], self.eargs.device)
        return self._hf_models[dtype_name]

    def close(self) -> None:
        self._hf_models.clear()


def open_peer(name: str, ctx: PeerContext):
    """Build (and load) one peer; raises PeerUnavailable with the reason it cannot run."""
    if name.startswith("hf-"):
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise PeerUnavailable("transformers is not installed") from None
        from kvserve.bench.hf_peer import HFPeer

        _, dtype_name, mode = name.split("-")
        batch_size = None if mode == "seq" else (ctx.hf_batch_size or 0)
        return HFPeer(ctx.hf_model(dtype_name), dtype_name, batch_size)
    if name.startswith("llamacpp-"):
        from kvserve.bench import llamacpp_peer

        if llamacpp_peer.import_llama_cpp() is None:
            raise PeerUnavailable("llama-cpp-python is not installed "
                                  "(pip install 'kvserve[llamacpp]')")
        if ctx.source_kind != "gguf":
            raise PeerUnavailable(f"llama.cpp needs a GGUF file, not a {ctx.source_kind} model")
        path = ctx.source_path
        if name.startswith("llamacpp-q4_0-"):
            path = llamacpp_peer.requantize_q4_0(path)
        peer = (llamacpp_peer.LlamaCppSequential(path, ctx.num_threads) if name.endswith("-seq")
                else llamacpp_peer.LlamaCppBatched(path, ctx.num_threads))
        peer.name = name
        return peer
    if name.startswith("openvino-"):
        from kvserve.bench.openvino_export import OpenVinoVenv
        from kvserve.bench.openvino_peer import OpenVinoPeer, PipelineSettings

        venv = OpenVinoVenv.default()
        missing = venv.missing()
        if missing:
            raise PeerUnavailable(missing)
        if ctx.source_kind not in ("gguf", "hf_dir"):
            raise PeerUnavailable(f"OpenVINO needs a GGUF file or an HF directory, not a {ctx.source_kind} model")
        settings = PipelineSettings(ctx.num_threads, max_num_batched_tokens=ctx.eargs.max_num_batched_tokens,
                                    max_num_seqs=ctx.eargs.max_num_seqs)
        return OpenVinoPeer(name, ctx.source_kind, ctx.source_path, settings, venv)
    if name in ("kvserve-noprefix", "kvserve-noreclaim"):
        from kvserve.bench.kvserve_driver import KvserveDriver

        change = ({"enable_prefix_caching": False} if name == "kvserve-noprefix"
                  else {"disable_sliding_window_reclaim": True})
        driver = KvserveDriver(dataclasses.replace(ctx.eargs, **change))
        driver.name = name
        return driver
    if name in ("kvserve-nospec", "kvserve-ngram", "kvserve-draft"):
        from kvserve.bench.kvserve_driver import KvserveDriver

        spec = {"kvserve-nospec": None, "kvserve-ngram": NGRAM_PEER_CONFIG,
                "kvserve-draft": {**DRAFT_PEER_CONFIG, "model": ctx.eargs.model}}[name]
        driver = KvserveDriver(dataclasses.replace(ctx.eargs, speculative_config=spec))
        driver.name = name
        return driver
    if name in _WEIGHT_FORMAT_PEERS:
        from kvserve.bench.kvserve_driver import KvserveDriver

        driver = KvserveDriver(dataclasses.replace(ctx.eargs, quantization=_WEIGHT_FORMAT_PEERS[name]))
        driver.name = name
        return driver
    if name.startswith("kvserve-kv-"):
        from kvserve.bench.kvserve_driver import KvserveDriver

        driver = KvserveDriver(dataclasses.replace(ctx.eargs, kv_cache_dtype=name.removeprefix("kvserve-kv-")))
        driver.name = name
        return driver
    if name == "kvserve-blas":
        from kvserve.bench.kvserve_driver import KvserveDriver

        kernels = dataclasses.replace(parse_kernel_config(ctx.eargs.kernel_config), batch_invariant=False)
        driver = KvserveDriver(dataclasses.replace(ctx.eargs, kernel_config=kernels))
        driver.name = name
        return driver
    raise ConfigError(f"unknown peer {name!r}")
