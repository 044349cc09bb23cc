"""kvserve command line: serve | generate | chat | bench | profile."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from typing import Optional, Union

from kvserve import environment
from kvserve.config import (DEFAULT_MODEL, INT4_PREFILL_MODES, KV_CACHE_DTYPES, ConfigError, EngineArgs, KernelConfig,
                            parse_kernel_config)
from kvserve.executor.base import ExecutorError
from kvserve.config.speculative import parse_speculative_config
from kvserve.request import RequestRejected, SamplingParams
from kvserve.config.disagg import CONNECTORS, ROLES, DisaggConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="short name (smollm2-135m-instruct, gemma-3-270m, tiny-llama, tiny-gemma3), "
                        "a .gguf file, or an HF directory with config.json + *.safetensors")
    g.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    g.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory", type=_parse_kv_budget, default=None,
                   help="KV cache budget in bytes (suffixes K, M, G allowed), or 'auto': what is free after "
                        "the weights, less their mapped file and one step's workspace (default: an eighth "
                        "of free memory, at most 1 GiB)")
    g.add_argument("--num-blocks", type=int, default=None, help="explicit KV block count")
    g.add_argument("--max-num-batched-tokens", type=int, default=EngineArgs.max_num_batched_tokens)
    g.add_argument("--max-num-seqs", type=int, default=EngineArgs.max_num_seqs)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--no-prefix-caching", action="store_true", help="disable automatic prefix caching")
    g.add_argument("--no-chunked-prefill", action="store_true")
    g.add_argument("--no-sliding-window-reclaim", action="store_true",
                   help="keep every layer's KV for the whole context (sliding-window layers in one "
                        "full group with the others, as before KV cache groups)")
    g.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    g.add_argument("--quantization", default=None, choices=["none", "gguf", "bf16", "int8", "int4"],
                   help="weight format of the linear layers (activations stay in --dtype); "
                        "gguf: a GGUF's own blocks, no float copy (the default for a quantized GGUF "
                        "with --dtype auto on a CPU); int4 also reads GGUF blocks and adds prefill copies; "
                        "default for other models with --dtype auto on a CPU with fast bf16: bf16")
    g.add_argument("--int4-prefill", default=EngineArgs.int4_prefill, choices=INT4_PREFILL_MODES,
                   help="int4 mode's prompt tokens: through bf16 copies of the weights (bf16), "
                        "through the 4-bit blocks (blocks), per layer the faster of those two on this "
                        "CPU (auto), or through the blocks' byte codes under int8 activations (int8: faster with "
                        "AVX512-VNNI, ~1 point less top-1 agreement; never chosen by auto). A GGUF on its own "
                        "blocks (--quantization gguf) keeps no copy: int8 computes its prompt tokens on the "
                        "blocks under int8 activations (AVX512-VNNI; ~1.2-1.3x faster GEMMs, ~1 point less "
                        "top-1 agreement), the other modes under the decode rows' 16-bit ones")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over N worker processes (gloo on CPU, NCCL on CUDA)")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="split the layer stack into N stages, one worker process (group) each")
    g.add_argument("--worker-process", action="store_true",
                   help="run the model in a worker process even without parallelism")
    g.add_argument("--async-scheduling", action="store_true",
                   help="schedule and build step N+1 and process step N-1's outputs while a worker "
                        "process computes step N (implies --worker-process; speculative decoding, tensor and "
                        "pipeline parallelism keep the synchronous step)")
    g.add_argument("--distributed-timeout", type=float, default=EngineArgs.distributed_timeout_s,
                   metavar="SECONDS", help="a parallel worker silent this long is taken as hung "
                                           "and the engine stops")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    g.add_argument("--num-scheduler-steps", type=int, default=EngineArgs.num_scheduler_steps, metavar="N",
                   help="multi-step decoding: up to N decode steps per scheduling round while no "
                        "running request asks for logprobs, a grammar or penalties and none waits "
                        "(streams get bursts of up to N tokens)")
    g.add_argument("--kernel-config", default=None, metavar="JSON", type=_parse_kernel_config,
                   help='CPU kernel routes and numerics, e.g. \'{"attention_route": "widened", "step_teams": false}\' '
                        "(keys: native_kernels, cpu_march, bf16_route, attention_route, step_teams, "
                        "batch_invariant, shm_collectives, time_collectives)")


def _parse_kv_budget(text: str) -> Union[int, str]:
    return "auto" if text.strip().lower() == "auto" else _parse_bytes(text)


def _parse_bytes(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in "KMG" else text
    try:
        return int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r}") from None


def _parse_kernel_config(text: str) -> KernelConfig:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--kernel-config is not JSON: {exc}") from None
    try:
        return parse_kernel_config(value)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_disaggregation_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("prefill/decode disaggregation")
    g.add_argument("--disaggregate", action="store_true",
                   help="one host: run a prefill and a decode instance, pinned to --prefill-cpus and "
                        "--decode-cpus, behind a router on --host:--port")
    g.add_argument("--prefill-cpus", default=None, metavar="LIST", help="with --disaggregate: e.g. 0 or 0-3")
    g.add_argument("--decode-cpus", default=None, metavar="LIST", help="with --disaggregate: e.g. 1 or 4-7")
    g.add_argument("--disaggregation-mode", default=None, choices=ROLES,
                   help="serve as one side of a disaggregated pair (several hosts; `kvserve router` fronts them)")
    g.add_argument("--kv-connector", default="shm", choices=CONNECTORS,
                   help="how KV moves from prefill to decode: shm (one host) or tcp (two hosts)")
    g.add_argument("--kv-host", default="127.0.0.1", help="tcp: the prefill instance's KV address to bind")
    g.add_argument("--kv-port", type=int, default=0, help="tcp: the prefill instance's KV port (0: any)")
    g.add_argument("--kv-advertise-host", default=None,
                   help="tcp: the host name decode instances dial (default --kv-host)")
    g.add_argument("--kv-staging-ttl", type=float, default=DisaggConfig.staging_ttl_s, metavar="SECONDS",
                   help="prefill side: drop a published transfer nobody fetched after this long")
    g.add_argument("--kv-load-timeout", type=float, default=DisaggConfig.load_timeout_s, metavar="SECONDS",
                   help="decode side: a transfer silent this long has failed (the request is re-prefilled)")
    g.add_argument("--cpus", default=None, metavar="LIST",
                   help="pin this server to these CPUs (e.g. 0-3); --num-threads defaults to their number")


def disagg_config_from(ns: argparse.Namespace) -> Optional[DisaggConfig]:
    if ns.disaggregation_mode is None:
        return None
    return DisaggConfig(role=ns.disaggregation_mode, connector=ns.kv_connector, kv_host=ns.kv_host,
                        kv_port=ns.kv_port, kv_advertise_host=ns.kv_advertise_host,
                        staging_ttl_s=ns.kv_staging_ttl, load_timeout_s=ns.kv_load_timeout)


def engine_args_from(ns: argparse.Namespace, **overrides) -> EngineArgs:
    args = EngineArgs(
        model=ns.model, dtype=ns.dtype, device=ns.device, block_size=ns.block_size,
        kv_cache_memory=ns.kv_cache_memory, num_blocks=ns.num_blocks,
        max_num_batched_tokens=ns.max_num_batched_tokens, max_num_seqs=ns.max_num_seqs,
        max_model_len=ns.max_model_len, enable_prefix_caching=not ns.no_prefix_caching,
        enable_chunked_prefill=not ns.no_chunked_prefill, num_threads=ns.num_threads,
        disable_sliding_window_reclaim=ns.no_sliding_window_reclaim,
        seed=ns.seed, quantization=ns.quantization, int4_prefill=ns.int4_prefill, kv_cache_dtype=ns.kv_cache_dtype,
        speculative_config=parse_speculative_config(ns.speculative_config),
        num_scheduler_steps=ns.num_scheduler_steps,
        worker_process=ns.worker_process, async_scheduling=ns.async_scheduling,
        tensor_parallel_size=ns.tensor_parallel_size, pipeline_parallel_size=ns.pipeline_parallel_size,
        distributed_timeout_s=ns.distributed_timeout,
        kernel_config=ns.kernel_config or KernelConfig(),
    )
    return dataclasses.replace(args, **overrides)


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def sampling_params_from(ns: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p,
                          top_k=ns.top_k, min_p=ns.min_p, repetition_penalty=ns.repetition_penalty,
                          seed=ns.sampling_seed, stop=list(ns.stop), ignore_eos=ns.ignore_eos)


# ---------------------------------------------------------------------- generate / chat
def cmd_generate(ns: argparse.Namespace) -> int:
    from kvserve.llm import LLM

    params = sampling_params_from(ns)
    llm = LLM(**dataclasses.asdict(engine_args_from(ns)))
    print(llm.engine.describe_kv_cache(), file=sys.stderr)
    print(llm.engine.describe_memory(), file=sys.stderr)
    print(llm.engine.describe_kernels(), file=sys.stderr)
    if ns.input:
        return _generate_batch(llm, ns, params)
    if not ns.prompt:
        raise ConfigError("give a prompt, or --input prompts.jsonl")
    prompt = llm.chat_prompt_ids([{"role": "user", "content": ns.prompt}]) if ns.chat else ns.prompt
    for out in llm.stream(prompt, params):
        sys.stdout.write(out.outputs[0].delta_text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    m = out.metrics
    if m is not None and m.ttft is not None:
        tpot = f", TPOT {m.tpot * 1000:.1f} ms" if m.tpot else ""
        print(f"[{m.num_prompt_tokens} prompt tokens, {m.num_output_tokens} generated, "
              f"finish={out.outputs[0].finish_reason}, TTFT {m.ttft * 1000:.0f} ms{tpot}]",
              file=sys.stderr)
    return 0


def _read_jsonl_prompts(path: str) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
            if isinstance(row, str):
                row = {"prompt": row}
            if not isinstance(row, dict) or not ({"prompt", "messages", "prompt_token_ids"} & row.keys()):
                raise ConfigError(f"{path}:{lineno}: expected an object with 'prompt', "
                                  f"'messages' or 'prompt_token_ids'")
            rows.append(row)
    return rows


def _generate_batch(llm, ns: argparse.Namespace, default_params: SamplingParams) -> int:
    rows = _read_jsonl_prompts(ns.input)
    prompts, params = [], []
    for row in rows:
        if "messages" in row:
            prompts.append(llm.chat_prompt_ids(row["messages"]))
        elif "prompt_token_ids" in row:
            prompts.append(list(row["prompt_token_ids"]))
        else:
            prompts.append(row["prompt"])
        p = dataclasses.replace(default_params)
        for key in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                    "ignore_eos", "n"):
            if key in row:
                setattr(p, key, row[key])
        p.__post_init__()
        params.append(p)
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.token_ids) for r in outputs for o in r.outputs)
    out_f = open(ns.output, "w", encoding="utf-8") if ns.output else sys.stdout
    try:
        for row, r in zip(rows, outputs):
            record = {"id": row.get("id", r.request_id), "prompt": row.get("prompt"),
                      "outputs": [{"text": o.text, "token_ids": o.token_ids,
                                   "finish_reason": o.finish_reason} for o in r.outputs],
                      "num_prompt_tokens": len(r.prompt_token_ids)}
            out_f.write(json.dumps(record, ensure_ascii=False) + "\n")
    finally:
        if out_f is not sys.stdout:
            out_f.close()
    print(f"{len(outputs)} requests, {n_out} output tokens in {elapsed:.1f} s "
          f"({n_out / elapsed:.1f} tok/s)", file=sys.stderr)
    return 0


def cmd_chat(ns: argparse.Namespace) -> int:
    from kvserve.tokenizer import load_tokenizer
    from kvserve.llm import LLM
    from kvserve.loader import resolve_model

    params = sampling_params_from(ns)
    # Before the weights: a model without a template fails at once, not after loading it (the
    # engine then reuses this tokenizer load).
    if not load_tokenizer(resolve_model(ns.model)).has_chat_template:
        raise ConfigError(f"model {ns.model} has no chat template; use `kvserve generate`")
    llm = LLM(**dataclasses.asdict(engine_args_from(ns)))
    messages: list[dict] = []
    if ns.system:
        messages.append({"role": "system", "content": ns.system})
    print("kvserve chat — empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        reply = ""
        for out in llm.stream(llm.chat_prompt_ids(messages), params):
            delta = out.outputs[0].delta_text
            reply += delta
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": reply})
    return 0


# ---------------------------------------------------------------------- serve / bench / profile
def cmd_serve(ns: argparse.Namespace) -> int:
    from kvserve.server.app import EngineStopped, run_server

    from kvserve.executor.launch import run_torchrun_worker, torchrun_rank, under_torchrun

    if under_torchrun() and torchrun_rank() != 0:
        # Multi-node: torchrun starts this command on every rank; rank 0 serves, the others
        # are its tensor-parallel workers (kvserve/executor/launch.py).
        return run_torchrun_worker()
    if ns.disaggregate:
        return _serve_disaggregated(ns)
    if ns.prefill_cpus or ns.decode_cpus:
        raise ConfigError("--prefill-cpus and --decode-cpus go with --disaggregate")
    if ns.cpus:
        from kvserve.disagg.launcher import parse_cpus, pin_to_cpus

        cpus = parse_cpus(ns.cpus)
        pin_to_cpus(cpus)  # before the engine starts torch's threads
        ns.num_threads = ns.num_threads or len(cpus)
    eargs = engine_args_from(ns, max_waiting_requests=ns.max_waiting_requests, kv_transfer=disagg_config_from(ns))
    try:
        run_server(eargs, host=ns.host, port=ns.port, api_key=ns.api_key,
                   served_model_name=ns.served_model_name, log_level=ns.log_level,
                   shutdown_timeout=ns.shutdown_timeout, chat_template=ns.chat_template,
                   allowed_origins=[o.strip() for o in ns.allowed_origins.split(",") if o.strip()])
    except EngineStopped as exc:
        print(f"kvserve: error: the engine stopped: {exc}", file=sys.stderr)
        return 1
    return 0


def _serve_disaggregated(ns: argparse.Namespace) -> int:
    from kvserve.disagg.launcher import run_disaggregated

    if not (ns.prefill_cpus and ns.decode_cpus):
        raise ConfigError("--disaggregate needs --prefill-cpus and --decode-cpus (e.g. 0 and 1)")
    if ns.disaggregation_mode is not None:
        raise ConfigError("--disaggregate starts both instances itself: drop --disaggregation-mode")
    run_disaggregated(ns.serve_argv, ns.prefill_cpus, ns.decode_cpus, ns.host, ns.port,
                      connector=ns.kv_connector, log_level=ns.log_level)
    return 0


def cmd_router(ns: argparse.Namespace) -> int:
    from kvserve.disagg.router import RouterConfig, run_router

    run_router(RouterConfig(prefill_urls=ns.prefill, decode_urls=ns.decode, prefill_timeout_s=ns.prefill_timeout,
                            decode_timeout_s=ns.decode_timeout, health_interval_s=ns.health_interval),
               host=ns.host, port=ns.port, log_level=ns.log_level)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=environment.api_key(),
                   help="require this bearer token on every request (default: $KVSERVE_API_KEY; none: open)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--max-waiting-requests", type=int, default=None)
    p.add_argument("--log-level", default="info")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM/Ctrl-C: refuse new requests (503) and let those in flight "
                        "finish for up to this many seconds, then abort them (default 30)")
    p.add_argument("--allowed-origins", default="",
                   help="comma-separated browser origins allowed to call the API (CORS), "
                        "'*' for any (default: none)")
    p.add_argument("--chat-template", default=None, metavar="FILE|STRING",
                   help="the chat template to serve chat with (a Jinja file or the template "
                        "itself), for a model that has none or to replace its own")
    add_disaggregation_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("router", help="OpenAI front of disaggregated prefill and decode instances")
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL", help="prefill instances, e.g. http://a:8001")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode instances")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--prefill-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="bound on one prefill answer (hangs are caught sooner by the health checks)")
    p.add_argument("--decode-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="bound on a decode answer's silence")
    p.add_argument("--health-interval", type=float, default=1.0, metavar="SECONDS",
                   help="health checks of every instance this often; 3 failed in a row mark it down")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=cmd_router)

    p = sub.add_parser("generate", help="generate from a prompt (streams) or a JSONL file of prompts")
    add_engine_args(p)
    add_sampling_args(p)
    p.add_argument("prompt", nargs="?", default=None)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--input", default=None, help="JSONL: {prompt | messages | prompt_token_ids, ...}")
    p.add_argument("--output", default=None, help="JSONL output (default stdout)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat with the model's chat template")
    add_engine_args(p)
    add_sampling_args(p)
    p.add_argument("--system", default=None)
    p.set_defaults(func=cmd_chat)

    try:
        from kvserve.bench.cli import add_bench_parsers
    except ImportError:
        add_bench_parsers = None
    if add_bench_parsers is not None:
        add_bench_parsers(sub, add_engine_args, engine_args_from)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    parser = build_parser()
    ns = parser.parse_args(argv)
    # The launcher of --disaggregate passes the user's serve flags on to its instances.
    raw = list(sys.argv[1:] if argv is None else argv)
    ns.serve_argv = raw[1:] if raw and raw[0] == "serve" else raw
    try:
        return ns.func(ns)
    except (ConfigError, RequestRejected) as exc:
        print(f"kvserve: error: {exc}", file=sys.stderr)
        return 2
    except ExecutorError as exc:  # a parallel worker died, hung or failed
        print(f"kvserve: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
