"""`shoal serve` flags. Cheap to import: the server (and torch) load only in `run`.

vLLM's spellings a user types work too: --gpu-memory-utilization, --tokenizer (the model's
own only), --chat-template, --max-logprobs, --root-path, --allowed-origins,
--disable-log-stats, --enable-auto-tool-choice, --tool-call-parser, --tool-parser-plugin,
--reasoning-parser, --stream-interval, --enable-tokenizer-info-endpoint."""

from __future__ import annotations

import argparse
import json
import logging
import os


class HelpFormatter(argparse.HelpFormatter):
    """Like ArgumentDefaultsHelpFormatter, without '(default: None)' and without repeating a
    default the help text already states."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS, False) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def _origins(text: str) -> list[str]:
    """A JSON list (vLLM's form) or comma-separated origins."""
    text = text.strip()
    if text.startswith("["):
        value = json.loads(text)
        if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
            raise argparse.ArgumentTypeError("--allowed-origins: a JSON list of strings")
        return value
    return [x.strip() for x in text.split(",") if x.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from shoal.runtime.config import add_engine_args

    add_engine_args(parser)
    v = parser.add_argument_group("vLLM spellings")
    v.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="on GPU: the fraction (0, 1] of free device memory for the KV cache (as --kv-cache-memory FRACTION); ignored on CPU (default: unset)")
    v.add_argument("--tokenizer", default=None, help="the tokenizer to use; only the model's own is supported (default: the model's)")
    v.add_argument("--chat-template", default=None, help="a Jinja chat template, or a file holding one, used instead of the model's (default: the model's)")
    v.add_argument("--max-logprobs", type=int, default=20, help="most log-probabilities per token a request may ask for (at most 20)")
    v.add_argument("--root-path", default=None, help="path prefix when behind a proxy that strips it (ASGI root_path) (default: none)")
    v.add_argument("--allowed-origins", type=_origins, default=None,
                   help="CORS: origins allowed to call the API, a JSON list or comma-separated (default: no CORS headers)")
    v.add_argument("--disable-log-stats", action="store_true", help="no periodic stats line in the log")
    v.add_argument("--stream-interval", type=int, default=1,
                   help="tokens per streamed event: 1 sends each token as it is made; N holds a choice's tokens until N gathered (its first and last go at once)")
    v.add_argument("--enable-tokenizer-info-endpoint", action=argparse.BooleanOptionalAction, default=True,
                   help="serve GET /tokenizer_info (the tokenizer's config and chat template, vLLM's shape); on unless --no-enable-tokenizer-info-endpoint")
    t = parser.add_argument_group("tool calling (vLLM's flags; docs/tools.md)")
    t.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='allow tool_choice "auto" (the default when tools are given): parse the model\'s tool calls with --tool-call-parser')
    t.add_argument("--tool-call-parser", default=None,
                   help="the parser that finds tool calls in the model's text: hermes, llama3_json, mistral, or one a --tool-parser-plugin registers (default: none)")
    t.add_argument("--tool-parser-plugin", default=None, help="a Python file to import that registers tool-call parsers (default: none)")
    r = parser.add_argument_group("reasoning (vLLM's flag; docs/reasoning.md)")
    r.add_argument("--reasoning-parser", default=None,
                   help="split the thinking out of chat answers into reasoning_content: qwen3 or deepseek_r1 (default: none)")
    g = parser.add_argument_group("server")
    # 0.0.0.0 by default: in a pod the kubelet probes the pod IP, so loopback would fail
    # every probe. Pass --host 127.0.0.1 to keep a workstation server private.
    g.add_argument("--host", default=os.environ.get("SHOAL_HOST", "0.0.0.0"), help="address to bind; $SHOAL_HOST")
    g.add_argument("--port", type=int, default=int(os.environ.get("SHOAL_PORT", "8000")), help="port to bind; $SHOAL_PORT")
    g.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/*; default: $SHOAL_API_KEY (probes and /metrics stay open)",
    )
    g.add_argument("--max-waiting", type=int, default=512, help="requests allowed to wait beyond the running batch's free slots; beyond it 503 + Retry-After")
    g.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get to finish after SIGTERM")
    g.add_argument("--stall-timeout", type=float, default=60.0, help="/health fails when work is pending and no step finished for this long (seconds)")
    g.add_argument("--max-body-bytes", type=int, default=8 * 2**20, help="largest request body accepted (413 beyond)")
    g.add_argument("--engine-core-process", action="store_true",
                   help="run the engine core (schedule, execute, sample) in a process of its own; this one detokenizes, "
                        "checks stop strings and streams while the core runs the next step (docs/engine.md)")
    g.add_argument("--log-stats-interval", type=float, default=10.0, help="seconds between the periodic stats lines")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log level")
    parser.set_defaults(func=run)


def _resolve_vllm_spellings(args: argparse.Namespace) -> None:
    log = logging.getLogger("shoal.server")
    if args.gpu_memory_utilization is not None:
        if not 0 < args.gpu_memory_utilization <= 1:
            raise SystemExit("--gpu-memory-utilization must be in (0, 1]")
        if (args.device or "cpu").startswith("cuda"):
            if args.kv_cache_memory is None:
                args.kv_cache_memory = args.gpu_memory_utilization
        else:
            log.warning("--gpu-memory-utilization is ignored on CPU; size the KV cache with --kv-cache-memory")
    if args.tokenizer is not None:
        from shoal.runtime.models.loader import resolve_model

        if os.path.realpath(str(resolve_model(args.tokenizer))) != os.path.realpath(str(resolve_model(args.model))):
            raise SystemExit("--tokenizer: only the model's own tokenizer is supported")
    args.chat_template_text = None
    if args.chat_template is not None:
        path = args.chat_template
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                args.chat_template_text = f.read()
        elif "{" in path:
            args.chat_template_text = path
        else:
            raise SystemExit(f"--chat-template: no such file {path!r} (and not a template)")
    if args.stream_interval < 1:
        raise SystemExit("--stream-interval must be >= 1")
    if not 0 <= args.max_logprobs <= 20:
        raise SystemExit("--max-logprobs must be in [0, 20]")
    _check_tool_flags(args)
    _check_reasoning_flags(args)


def _check_reasoning_flags(args: argparse.Namespace) -> None:
    from shoal.runtime.entrypoints.reasoning_parsers import reasoning_parser_names

    if args.reasoning_parser is not None and args.reasoning_parser not in reasoning_parser_names():
        raise SystemExit(f"--reasoning-parser {args.reasoning_parser!r}: known parsers are {', '.join(reasoning_parser_names())}")


def _check_tool_flags(args: argparse.Namespace) -> None:
    from shoal.runtime.entrypoints.tool_parsers import load_tool_parser_plugin, tool_parser_names

    if args.tool_parser_plugin:
        if not os.path.isfile(args.tool_parser_plugin):
            raise SystemExit(f"--tool-parser-plugin: no such file {args.tool_parser_plugin!r}")
        load_tool_parser_plugin(args.tool_parser_plugin)
    if args.tool_call_parser is not None and args.tool_call_parser not in tool_parser_names():
        raise SystemExit(f"--tool-call-parser {args.tool_call_parser!r}: known parsers are {', '.join(tool_parser_names())}")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise SystemExit("--enable-auto-tool-choice needs --tool-call-parser")


def run(args: argparse.Namespace) -> int:
    from shoal.runtime.entrypoints.server import serve

    if args.api_key is None:
        args.api_key = os.environ.get("SHOAL_API_KEY") or None
    for name in ("max_waiting", "max_body_bytes"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("drain_timeout", "stall_timeout"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be > 0")
    _resolve_vllm_spellings(args)
    return serve(args)
