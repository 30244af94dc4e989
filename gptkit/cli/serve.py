"""`gptkit serve`: an OpenAI-compatible HTTP server (completions, chat, streaming) with a playground at /."""

from __future__ import annotations

import argparse
import os
import sys

from gptkit.cli.flags import add_dataclass_flags, dataclass_from_args
from gptkit.errors import GptkitError

API_KEY_ENV = "GPTKIT_API_KEY"  # read when --api-key is not given


# Shown by `gptkit --help`, which imports no command's dependencies.
HELP = "serve a model over an OpenAI-compatible HTTP API with a playground page"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `serve` sub-command; its flags come from ServeOptions."""
    from gptkit.serving.server import ServeOptions

    parser = subparsers.add_parser(
        "serve",
        help=HELP,
        description="Serve MODEL_DIR over HTTP: POST /v1/completions, POST /v1/chat/completions (streaming with "
        "stream=true), GET /v1/models, GET /health, and a playground page at /. Concurrent requests are decoded "
        "together in one batch.",
    )
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="a gptkit (or Hugging Face) model directory")
    add_dataclass_flags(parser, ServeOptions)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Start the server and block until Ctrl-C."""
    from gptkit.loading import resolve_model_path
    from gptkit.serving.middleware import is_loopback
    from gptkit.serving.server import ServeOptions, serve

    options = dataclass_from_args(ServeOptions, args)
    if options.api_key is None and os.environ.get(API_KEY_ENV):
        options.api_key = os.environ[API_KEY_ENV]  # keeps the key out of the process list
    if not is_loopback(options.host) and not options.api_key:
        print(
            f"gptkit serve: warning: binding {options.host} without --api-key lets anyone who can reach this "
            "machine use the model",
            file=sys.stderr,
        )
    model_dir = resolve_model_path(args.model_dir)  # a run directory: its newest checkpoint
    check_port_free(options.host, options.port)  # before the model loads, and before its URL is printed
    host = f"[{options.host}]" if ":" in options.host else options.host  # an IPv6 address goes in brackets
    where = f"http://{host}:{options.port}/" if options.port else "the address uvicorn prints (port 0: a free one)"
    print(f"gptkit serve: loading {model_dir}; the playground will be at {where}", file=sys.stderr, flush=True)
    serve(str(model_dir), options)
    return 0


def check_port_free(host: str, port: int) -> None:
    """A one-line error when host:port cannot be listened on (another server has it, or no such address)."""
    import socket

    if port == 0:  # the system picks a free one
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: a closed server's port is free
        try:
            probe.bind((host, port))
        except OSError as err:
            raise GptkitError(
                f"cannot listen on {host}:{port}: {err.strerror or err}; is another server on it? "
                "Stop it or pick another --port"
            ) from None
