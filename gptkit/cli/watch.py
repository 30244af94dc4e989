"""`gptkit watch`: a live page of a training run (losses, ICL and induction scores, heads, samples)."""

from __future__ import annotations

import argparse
import sys

from gptkit.errors import GptkitError

# Shown by `gptkit --help`, which imports no command's dependencies.
HELP = "a live page of a training run: losses, ICL and induction scores, heads, Olsson's map, samples"
DEFAULT_PORT = 8800


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `watch` sub-command."""
    parser = subparsers.add_parser(
        "watch",
        help=HELP,
        description="Serve a page that shows RUN_DIR as it trains and updates itself within seconds of each "
        "evaluation. It reads only the run directory (a finished run, or one copied or mounted from another "
        "machine, shows the same page) and needs no internet and no model.",
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a gptkit train run directory (its --out)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind; 0.0.0.0 exposes the page")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="TCP port (0 picks a free one)")
    parser.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a host name the page may be opened by besides loopback ones (while the server binds a "
        "loopback address, any other Host header is refused); repeatable",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Check the run directory, bind the port, print the page's URL and serve until Ctrl-C."""
    from gptkit.observe.run_reader import check_run_dir
    from gptkit.serving.middleware import is_loopback
    from gptkit.serving.watch import listen, serve_watch

    run_dir = check_run_dir(args.run_dir)
    blank = next((name for name in args.allowed_host if not name.strip()), None)
    if blank is not None:
        raise GptkitError(
            f"--allowed-host {blank!r} names no host: give a host name such as mybox.lan (loopback names need no flag)"
        )
    sock = listen(args.host, args.port)
    loopback = is_loopback(args.host)
    if not loopback:
        print(
            f"gptkit watch: warning: binding {args.host} lets anyone who can reach this machine read the run's "
            "metrics and samples",
            file=sys.stderr,
        )
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host  # an IPv6 address goes in brackets
    print(f"gptkit watch: {run_dir} at http://{shown}:{port}/", file=sys.stderr, flush=True)
    serve_watch(run_dir, sock, tuple(args.allowed_host) if loopback else None)
    return 0
