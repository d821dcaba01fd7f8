"""``kvforge serve``: build the engine from CLI flags and serve it over HTTP.

Wiring (kvforge/cli.py)::

    from kvforge.server.cli import add_serve_args, serve_main
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_serve_args(p)
    p.set_defaults(func=serve_main)      # serve_main(namespace) -> exit code

``serve_main`` also accepts an argv list (``serve_main(["--port", "8001"])``).
"""

from __future__ import annotations

import argparse
import logging
import sys

from kvforge.cli_args import ArgumentParser, parse_bytes
from kvforge.cli_vllm_flags import SERVER_FLAGS, add_vllm_flags
from kvforge.errors import KVForgeError
from kvforge.server.cors import CorsPolicy, parse_json_list
from kvforge.server.request_defaults import RequestDefaults, parse_template_kwargs
from kvforge.server.tool_parsers import PARSERS

#: The largest request body the server reads (``--max-request-bytes``): a batch of long token-id prompts, as
#: lm-eval's loglikelihood requests send them, fits; a body past it is refused before it is read.
DEFAULT_MAX_REQUEST_BYTES = 128 << 20

logger = logging.getLogger("kvforge.server")


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from kvforge.config import EngineArgs

    EngineArgs.add_cli_args(parser)  # positional MODEL, engine flags, --served-model-name, --seed
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: local only)")
    g.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every /v1 route and the tokenizer routes "
                        "(default: $KVFORGE_API_KEY; neither set: no auth)")
    g.add_argument("--max-queued-requests", type=int, default=1024,
                   help="requests allowed to wait for the engine before new ones get 503 (default 1024)")
    g.add_argument("--max-request-bytes", type=parse_bytes, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="largest request body accepted, bytes or a size such as 2MiB; larger gets 413 (default "
                        "128 MiB: a batch of long token-id prompts, as lm-eval sends, fits)")
    g.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="seconds in-flight requests may run after SIGTERM before they are aborted (default 30)")
    g.add_argument("--enable-log-requests", action="store_true",
                   help="log each generation request at INFO: route, prompts, n, max tokens, stream (vLLM's flag)")
    g.add_argument("--enable-log-outputs", action="store_true",
                   help="log each choice's output text when it ends (vLLM's flag)")
    g.add_argument("--max-log-len", type=int, default=None, metavar="N",
                   help="log at most N characters of an output (vLLM's flag; default: all)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="serve tool_choice \"auto\" (OpenAI's default with tools): the model chooses whether to "
                        "call, and --tool-call-parser finds its calls (vLLM's flag)")
    g.add_argument("--tool-call-parser", default=None, choices=sorted(PARSERS),
                   help="the syntax the model writes tool calls in: hermes (<tool_call>{json}</tool_call>, as "
                        "Hermes and Qwen 2.5/3 write them), llama3_json (a JSON object per call, as Llama "
                        "3.1-3.3 write them), pythonic ([f(x=1), g()], Llama 3.2 and 4), mistral "
                        "([TOOL_CALLS] and the calls) or openai (gpt-oss's harmony messages to=functions.NAME)")
    g.add_argument("--default-chat-template-kwargs", default=None, metavar="JSON",
                   help="chat template variables every chat gets unless it sends its own, e.g. "
                        "'{\"enable_thinking\": false}' (vLLM's flag)")
    g.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs name tokens as token_id:N unless a request says otherwise (vLLM's flag)")
    g.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help="a chat with tool_choice none renders without its tools (vLLM's flag)")
    g.add_argument("--enable-request-id-headers", action="store_true",
                   help="responses carry an X-Request-Id header: the request's own, or a new one (vLLM's flag)")
    g.add_argument("--responses-store-size", type=int, default=0, metavar="N",
                   help="keep the last N responses of /v1/responses in memory, for previous_response_id and "
                        "GET /v1/responses/{id} (default 0: none kept)")
    g.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage carries prompt_tokens_details.cached_tokens: the prompt tokens read from the "
                        "prefix cache (vLLM's flag)")
    g.add_argument("--allowed-origins", default='["*"]', metavar="JSON",
                   help="browser origins that may call the server, as a JSON list (vLLM's flag; default every "
                        "origin: '[\"*\"]')")
    g.add_argument("--allowed-methods", default='["*"]', metavar="JSON",
                   help="HTTP methods a browser may send, as a JSON list (vLLM's flag; default all)")
    g.add_argument("--allowed-headers", default='["*"]', metavar="JSON",
                   help="request headers a browser may send, as a JSON list (vLLM's flag; default all)")
    g.add_argument("--allow-credentials", action="store_true",
                   help="let browsers send cookies and HTTP auth to the allowed origins (vLLM's flag)")
    add_vllm_flags(parser, SERVER_FLAGS, "server")
    return parser


def cors_policy(ns) -> CorsPolicy:
    """The CORS policy the flags give (ConfigError naming a flag that is not a JSON list of strings)."""
    return CorsPolicy(origins=parse_json_list("--allowed-origins", ns.allowed_origins),
                      methods=parse_json_list("--allowed-methods", ns.allowed_methods),
                      headers=parse_json_list("--allowed-headers", ns.allowed_headers),
                      credentials=ns.allow_credentials)


def check_server_flags(ns) -> None:
    """What argparse cannot check of the server's flags alone (ConfigError); ``kvforge plan`` checks them
    too."""
    from kvforge.errors import ConfigError

    if not 0 <= ns.port <= 65535:
        raise ConfigError(f"--port must be in [0, 65535], got {ns.port}")
    if ns.max_queued_requests < 1:
        raise ConfigError(f"--max-queued-requests must be >= 1, got {ns.max_queued_requests}")
    if ns.max_request_bytes < 1024:
        raise ConfigError(f"--max-request-bytes must be >= 1024, got {ns.max_request_bytes}")
    if ns.responses_store_size < 0:
        raise ConfigError(f"--responses-store-size must be >= 0, got {ns.responses_store_size}")
    if ns.max_log_len is not None and ns.max_log_len < 0:
        raise ConfigError(f"--max-log-len must be >= 0, got {ns.max_log_len}")
    if ns.shutdown_grace < 0:
        raise ConfigError(f"--shutdown-grace must be >= 0, got {ns.shutdown_grace}")
    if ns.enable_auto_tool_choice and ns.tool_call_parser is None:
        raise ConfigError(f"--enable-auto-tool-choice needs --tool-call-parser (one of {', '.join(sorted(PARSERS))}): the "
                          f"syntax the model writes its calls in")
    if ns.tool_call_parser is not None and not ns.enable_auto_tool_choice:
        raise ConfigError("--tool-call-parser is read only with --enable-auto-tool-choice; add it")
    parse_template_kwargs(ns.default_chat_template_kwargs)
    cors_policy(ns)


def serve_main(args) -> int:
    """Entry point for ``kvforge serve``. Returns the process exit code."""
    if args is None or isinstance(args, (list, tuple)):
        parser = add_serve_args(ArgumentParser(prog="kvforge serve"))
        args = parser.parse_args(list(args) if args is not None else None)
    if not logging.getLogger().handlers:  # standalone use; `kvforge serve` configures logging itself
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The HTTP stack (aiohttp, prometheus_client) is imported before anything loads: a missing
    # dependency fails here, not after the weights.
    try:
        from kvforge.server.api_keys import SERVER_API_KEY_ENV, server_api_key
        from kvforge.server.app import bind_socket, create_app, serve
    except ImportError as e:
        print(f"kvforge serve: error: {e}; the server needs aiohttp and prometheus_client "
              f"(pip install aiohttp prometheus_client, or reinstall kvforge)", file=sys.stderr)
        return 2

    try:
        from kvforge.config import EngineArgs
        from kvforge.engine.llm_engine import LLMEngine

        check_server_flags(args)
        template_kwargs = parse_template_kwargs(args.default_chat_template_kwargs)
        engine_args = EngineArgs.from_cli_args(args)
    except KVForgeError as e:
        print(f"kvforge serve: error: {e}", file=sys.stderr)
        return 2
    # The address is bound before the engine exists: a port in use or a host that does not resolve
    # stops us before weights load.
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        print(f"kvforge serve: error: cannot listen on {args.host}:{args.port}: {e}; fix: choose another "
              f"--port (or stop what listens there) or a --host of this machine", file=sys.stderr)
        return 2
    try:
        # from_engine_args resolves the KV plan first: a PlanError/ConfigError stops us before weights load.
        engine = LLMEngine.from_engine_args(engine_args)
    except KVForgeError as e:
        sock.close()
        print(f"kvforge serve: error: {e}", file=sys.stderr)
        return 2
    except BaseException:
        sock.close()
        raise
    logger.info("serving %s (max_model_len %d)", engine.model_name, engine.max_model_len)
    api_key = server_api_key(args.api_key)
    if api_key and not args.api_key:
        logger.info("requiring the API key from $%s", SERVER_API_KEY_ENV)

    app = create_app(
        engine,
        api_key=api_key,
        max_queued_requests=args.max_queued_requests,
        max_request_bytes=args.max_request_bytes,
        shutdown_grace_s=args.shutdown_grace,
        log_requests=args.enable_log_requests,
        log_outputs=args.enable_log_outputs,
        max_log_len=args.max_log_len,
        tool_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
        prompt_tokens_details=args.enable_prompt_tokens_details,
        request_defaults=RequestDefaults(template_kwargs, args.return_tokens_as_token_ids,
                                         args.exclude_tools_when_tool_choice_none),
        request_id_headers=args.enable_request_id_headers,
        responses_store_size=args.responses_store_size,
        cors=cors_policy(args),
    )
    if args.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        logger.warning("listening on %s without --api-key or $%s: anyone who can reach this port can use it", args.host,
                       SERVER_API_KEY_ENV)
    try:
        return serve(app, args.host, args.port, sock=sock)
    except OSError as e:  # another server began listening on the port while the engine loaded
        print(f"kvforge serve: error: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 2
    finally:
        engine.shutdown()  # tensor-parallel workers stop with the server


if __name__ == "__main__":
    sys.exit(serve_main(sys.argv[1:]))
