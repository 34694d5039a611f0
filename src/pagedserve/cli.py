"""The `pagedserve` command: generate, chat, serve and bench."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from pagedserve.config import EXECUTOR_BACKENDS
from pagedserve.engine.router import ROUTING_POLICIES
from pagedserve.engine_args import add_engine_args, engine_config
from pagedserve.server.guard import DEFAULT_MAX_REQUEST_BYTES
from pagedserve.server.tool_calls import PARSERS


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
        type=_positive_int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="largest request body accepted; larger ones get 413",
    )
    group.add_argument("--log-interval", type=float, default=5.0, help="seconds between stat lines")
    group.add_argument(
        "--max-stored-responses",
        type=_positive_int,
        default=1024,
        help="responses kept for previous_response_id and GET /v1/responses/{id} (LRU)",
    )
    group.add_argument(
        "--no-ui", action="store_true", help="no page at / (chat, and the engine at work)"
    )
    scale = parser.add_argument_group("replicas (docs/SCALING.md)")
    scale.add_argument(
        "--data-parallel-size",
        "-dp",
        type=_positive_int,
        default=1,
        help="engines serving requests side by side, each a Ray actor (with "
        "--distributed-executor-backend ray)",
    )
    scale.add_argument(
        "--distributed-executor-backend",
        choices=EXECUTOR_BACKENDS,
        default="mp",
        help="mp: the engine in this process (its tensor-parallel ranks as processes); ray: "
        "every replica a Ray actor, restarted if it dies",
    )
    scale.add_argument(
        "--ray-address",
        default=None,
        help="an existing Ray cluster (host:port); default: a local Ray instance started for "
        "the server",
    )
    scale.add_argument(
        "--routing-policy",
        choices=ROUTING_POLICIES,
        default="prefix",
        help="which replica takes a request: the one likely holding its prefix (else the least "
        "loaded), the least loaded, or each in turn",
    )
    tools = parser.add_argument_group("tool calling")
    tools.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto" (the default with tools): the model decides, its calls read '
        "by --tool-call-parser",
    )
    tools.add_argument(
        "--tool-call-parser",
        choices=tuple(PARSERS),
        default=None,
        help="how the model writes tool calls: hermes (Qwen, Hermes), llama3_json, mistral",
    )
    cors = parser.add_argument_group("CORS (off unless --allowed-origins is given)")
    cors.add_argument(
        "--allowed-origins", type=_json_list, default=None,
        help='origins browsers may call from, a JSON list: \'["https://app.example"]\'',
    )  # fmt: skip
    cors.add_argument("--allowed-methods", type=_json_list, default=["*"], help="a JSON list")
    cors.add_argument("--allowed-headers", type=_json_list, default=["*"], help="a JSON list")
    cors.add_argument("--allow-credentials", action="store_true", help="allow cookies and auth")


def _json_list(value: str) -> list[str]:
    """vLLM's spelling of a list flag: a JSON list of strings."""
    try:
        items = json.loads(value)
    except json.JSONDecodeError:
        items = None
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        raise argparse.ArgumentTypeError(f'expected a JSON list of strings like ["*"], got {value}')
    return items


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


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
    from pagedserve.server.serve import serve

    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    serve(args, engine_config(args))


def _bench(args: argparse.Namespace) -> None:
    from pagedserve.bench.cli import main

    main(args.bench_args)


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

    bench = commands.add_parser(
        "bench",
        add_help=False,
        help="benchmarks: serve, throughput, sweep, report (the pagedserve[bench] extra)",
    )
    bench.add_argument("bench_args", nargs=argparse.REMAINDER)
    bench.set_defaults(handler=_bench)
    return parser


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # all of the rest is the benchmarks' own, options included
        args = argparse.Namespace(handler=_bench, bench_args=argv[1:])
    else:
        args = build_parser().parse_args(argv)
    try:
        args.handler(args)
    except (ValueError, FileNotFoundError) as error:
        sys.exit(f"pagedserve: error: {error}")


if __name__ == "__main__":
    main()
