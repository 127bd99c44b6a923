"""Command-line interface: `lmserve serve …` (more commands arrive with the model store)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lmserve.config import ConfigError, ServerConfig, env_name, resolve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmserve", description="Serve open-weight chat models over HTTP.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        help="run the HTTP server",
        description="Load a model and serve the OpenAI-compatible routes. Every flag can also be set with the "
        "LMSERVE_* environment variable named in its help; a flag wins over the variable.",
    )
    serve.add_argument("model", nargs="?", help=f"model name or path to a .gguf file (default smollm2:135m; "
                       f"{env_name('model')})")
    serve.add_argument("-m", "--model-path", dest="model_path", metavar="PATH", help="path to a .gguf file")
    serve.add_argument("--host", help=f"address to listen on (default 127.0.0.1; {env_name('host')})")
    serve.add_argument("--port", type=int, help=f"port to listen on (default 11434; {env_name('port')})")
    serve.add_argument("-c", "--ctx-size", dest="ctx_size", type=int, metavar="N",
                       help=f"context length PER SEQUENCE in tokens; each of the --parallel slots gets this many "
                       f"(default 4096; {env_name('ctx_size')})")
    serve.add_argument("-ngl", "--n-gpu-layers", dest="n_gpu_layers", type=int, metavar="N",
                       help=f"layers to offload to a GPU (default 0; {env_name('n_gpu_layers')})")
    serve.add_argument("-np", "--parallel", type=int, metavar="N",
                       help=f"sequences decoded together (default 4; {env_name('parallel')})")
    serve.add_argument("-t", "--threads", type=int, metavar="N",
                       help=f"CPU threads (default: all cores; {env_name('threads')})")
    serve.add_argument("--api-key", dest="api_key", metavar="KEY",
                       help=f"require 'Authorization: Key KEY' or 'Bearer KEY' ({env_name('api_key')})")
    serve.add_argument("-b", "--batch-size", dest="batch_size", type=int, metavar="N",
                       help=f"most tokens decoded in one step (default 512; {env_name('batch_size')})")
    serve.add_argument("--prefill-chunk", dest="prefill_chunk", type=int, metavar="N",
                       help=f"most prompt tokens prefilled in one step (default 256; {env_name('prefill_chunk')})")
    serve.add_argument("-a", "--alias", metavar="NAME", help=f"name the model answers to ({env_name('alias')})")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        flags = vars(args).copy()
        if flags.pop("model_path", None) is not None:
            flags["model"] = args.model_path
        try:
            config = resolve(flags)
        except ConfigError as exc:
            print(f"lmserve: {exc}", file=sys.stderr)
            return 2
        return _serve(config)
    return 2


def _serve(config: ServerConfig) -> int:
    from lmserve.server import run

    return run(config)
