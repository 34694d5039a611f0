"""The `pagedserve` command: generate, chat, serve and bench."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import fields

from pagedserve.bench.cli import add_bench_parser
from pagedserve.config import (
    DTYPES,
    KV_CACHE_DTYPES,
    PACKED_WEIGHT_DTYPES,
    SCHEDULER_POLICIES,
    EngineConfig,
)
from pagedserve.server.guard import DEFAULT_MAX_REQUEST_BYTES


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    defaults = {f.name: f.default for f in fields(EngineConfig)}
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=None, help="checkpoint dir or .gguf (default: SmolLM2)")
    group.add_argument("--dtype", choices=DTYPES, default=defaults["dtype"])
    group.add_argument("--device", default=defaults["device"], help="auto, cpu, cuda, cuda:1")
    group.add_argument("--block-size", type=int, default=defaults["block_size"])
    group.add_argument("--max-num-seqs", type=int, default=defaults["max_num_seqs"])
    group.add_argument(
        "--max-num-batched-tokens", type=int, default=defaults["max_num_batched_tokens"]
    )
    group.add_argument("--kv-cache-memory", default=defaults["kv_cache_memory"])
    group.add_argument("--num-kv-blocks", type=int, default=None)
    group.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=defaults["kv_cache_dtype"],
        help="what cached keys and values are stored as (auto: the model's dtype); bfloat16 "
        "under a float32 model holds twice the tokens and halves what decode attention reads",
    )
    group.add_argument("--scheduler", choices=SCHEDULER_POLICIES, default=defaults["scheduler"])
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument(
        "--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false"
    )
    group.add_argument(
        "--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false"
    )
    group.add_argument(
        "--no-cpu-kernels",
        dest="cpu_kernels",
        action="store_false",
        help="float32 on CPU: F.linear on weights as loaded, and torch's RMSNorm, SiLU and "
        "rotation, instead of the C++ kernels (decode attention: --no-decode-kernel)",
    )
    group.add_argument(
        "--packed-weight-dtype",
        choices=PACKED_WEIGHT_DTYPES,
        default=defaults["packed_weight_dtype"],
        help="float32 on CPU: store the packed linear weights as this (float32 arithmetic but for "
        "q4_1_q8); auto is q4_1, q8_0 or bfloat16 for a GGUF file whose linear maps are all Q4_1 "
        "(the default model), Q8_0 or BF16, chosen alike for its logits' weights, bfloat16 for a "
        "checkpoint stored in bfloat16, else float32; bfloat16 halves the bytes a decode step "
        "reads and rounds the weights, int8 quarters them and quantizes each output feature with "
        "its own scale, q8_0 and q4_1 store 8.5 and 5 bits a weight in llama.cpp's formats (a "
        "Q8_0 or Q4_1 GGUF's weights exactly; q4_1 with Q8_0 logits), q4_1_q8 stores q4_1's "
        "blocks and computes as llama.cpp does, in integers against each linear map's inputs "
        "rounded to 8 bits per group of 32 (AVX2 CPUs)",
    )
    group.add_argument(
        "--no-decode-kernel",
        dest="decode_kernel",
        action="store_false",
        help="on CPU, gather cached blocks for SDPA instead of the C++ decode attention",
    )
    group.add_argument("--seed", type=int, default=defaults["seed"])


def engine_config(args: argparse.Namespace) -> EngineConfig:
    names = {f.name for f in fields(EngineConfig)}
    return EngineConfig(**{name: getattr(args, name) for name in names if hasattr(args, name)})


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    group.add_argument("--served-model-name", default=None)
    group.add_argument(
        "--max-waiting", type=int, default=1024, help="queue length beyond which requests get 503"
    )
    group.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="largest request body accepted; larger ones get 413",
    )
    group.add_argument("--log-interval", type=float, default=5.0, help="seconds between stat lines")


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=256)
    group.add_argument("--temperature", type=float, default=0.7)
    group.add_argument("--top-p", type=float, default=0.9)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--sampling-seed", type=int, default=None)


def _sampling_params(args: argparse.Namespace):
    from pagedserve.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
    )


def _stream_reply(llm, prompt, params) -> str:
    reply = []
    for output in llm.engine.stream(prompt, params):
        print(output.new_text, end="", flush=True)
        reply.append(output.new_text)
    print()
    return "".join(reply)


def _generate(args: argparse.Namespace) -> None:
    from pagedserve.llm import LLM

    params = _sampling_params(args)
    llm = LLM(**vars(engine_config(args)))
    prompt = args.prompt
    if not args.raw and llm.get_tokenizer().chat_template is not None:
        prompt = {"prompt_token_ids": llm.chat_token_ids([{"role": "user", "content": prompt}])}
    _stream_reply(llm, prompt, params)


def _chat(args: argparse.Namespace) -> None:
    from pagedserve.llm import LLM

    params = _sampling_params(args)
    llm = LLM(**vars(engine_config(args)))
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("Chat with the model; an empty line or Ctrl-D ends it.", file=sys.stderr)
    while True:
        try:
            message = input("> ").strip()
        except EOFError:
            break
        if not message:
            break
        history.append({"role": "user", "content": message})
        prompt = {"prompt_token_ids": llm.chat_token_ids(history)}
        history.append({"role": "assistant", "content": _stream_reply(llm, prompt, params)})


def _serve(args: argparse.Namespace) -> None:
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.server.serve import serve

    serve(args, LLMEngine(engine_config(args)))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="stream a reply to one prompt")
    generate.add_argument("prompt")
    generate.add_argument("--raw", action="store_true", help="complete the text, no chat template")
    add_engine_args(generate)
    _add_sampling_args(generate)
    generate.set_defaults(handler=_generate)

    chat = commands.add_parser("chat", help="interactive chat on the terminal")
    chat.add_argument("--system", default=None, help="a system message")
    add_engine_args(chat)
    _add_sampling_args(chat)
    chat.set_defaults(handler=_chat)

    serve = commands.add_parser("serve", help="the OpenAI-compatible HTTP server")
    add_server_args(serve)
    add_engine_args(serve)
    serve.set_defaults(handler=_serve)

    add_bench_parser(commands, add_engine_args)
    return parser


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        args.handler(args)
    except (ValueError, FileNotFoundError) as error:
        sys.exit(f"pagedserve: error: {error}")


if __name__ == "__main__":
    main()
