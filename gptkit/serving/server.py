"""Load a model directory, start the batching engine and run the OpenAI-compatible app on uvicorn."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import socket
import threading
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

import torch
from fastapi import FastAPI

from gptkit.decoding.kv_store import KVStore
from gptkit.decoding.lookup import LOOKUP_K, LOOKUP_NGRAM, Lookup
from gptkit.decoding.prefix_cache import PrefixCache, available_memory, parse_size
from gptkit.devices import pick_device
from gptkit.errors import GptkitError
from gptkit.kv_cache import kv_dtype_of
from gptkit.quantization import QUANTIZATION_METHODS, is_quantized, quantize
from gptkit.serving.app import create_app
from gptkit.serving.embeddings import POOLINGS
from gptkit.serving.engine import Engine
from gptkit.serving.lora_registry import AdapterMisfit, AdapterRegistry, adapters_beside, resolved
from gptkit.serving.middleware import is_loopback
from gptkit.serving.state import ServerState
from gptkit.serving.threads import ThreadGovernor

DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_CACHE_DISK = 10 << 30

log = logging.getLogger("gptkit.serve")


@dataclass
class ServeOptions:
    """How `gptkit serve` runs; each field becomes a CLI flag with this default and help."""

    host: str = field(default="127.0.0.1", metadata={"help": "address to bind; 0.0.0.0 exposes the server"})
    port: int = field(default=8000, metadata={"help": "TCP port (0 picks a free one)"})
    api_key: str | None = field(
        default=None, metadata={"help": "require 'Authorization: Bearer KEY' (or set GPTKIT_API_KEY)"}
    )
    max_batch_size: int | None = field(
        default=None,
        metadata={
            "help": "requests decoded together in one batch (default: 32, as measured; fewer, down to 8, where "
            "their KV cache would take over a quarter of the free memory)"
        },
    )
    max_queue: int = field(default=64, metadata={"help": "requests that may wait for a batch row; beyond, 503"})
    max_body_bytes: int = field(default=1 << 20, metadata={"help": "largest request body accepted (413 beyond)"})
    model_name: str | None = field(default=None, metadata={"help": "model id clients send (default: dir name)"})
    device: str = field(default="auto", metadata={"help": "cpu, cuda, mps or auto"})
    threads: int | None = field(
        default=None, metadata={"help": "CPU threads for the model (default: every core this process may use)"}
    )
    quantize: str | None = field(
        default=None,
        metadata={"help": "weight-only quantisation of the loaded float model: int8 or int4 (llama.cpp's Q4_0)"},
    )
    kv_cache: str | None = field(
        default=None,
        metadata={
            "help": "int8: keep the keys and values as int8 with a "
            "scale per token and head (default: the model's "
            "dtype)"
        },
    )
    dtype: str = field(default="float32", metadata={"help": "weight precision", "choices": DTYPES})
    compile: bool = field(
        default=False, metadata={"help": "compile the decode step (every batch shape, before the server reports ready)"}
    )
    lookup: bool = field(
        default=False,
        metadata={
            "help": "speculate by prompt lookup for every request that does not say otherwise: the tokens that "
            "followed an earlier occurrence of the last few tokens are checked in one forward pass (faster where "
            'replies copy their prompt: edits, code); a request sets it with "lookup": true, false or '
            '{"k": K, "ngram": N}'
        },
    )
    lookup_k: int = field(
        default=LOOKUP_K, metadata={"help": "tokens prompt lookup proposes per check, and the most a request may ask"}
    )
    lookup_ngram: int = field(
        default=LOOKUP_NGRAM, metadata={"help": "the longest match prompt lookup looks for, in tokens (down to 1)"}
    )
    allowed_host: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "a host name requests may address besides loopback ones (while the server binds a loopback address, "
            "any other Host header is refused: a web page that rebinds its name to 127.0.0.1 cannot reach it); "
            "repeatable",
            "repeatable": True,
            "metavar": "NAME",
        },
    )
    head_timeout: float = field(
        default=10.0,
        metadata={
            "help": "seconds a connection may stay silent while it owes a "
            "request (or a body), and may take to send a "
            "request head once begun; closed beyond"
        },
    )
    max_connections: int = field(default=512, metadata={"help": "open connections at most; requests beyond get 503"})
    cache_ram: int | None = field(
        default=None,
        metadata={
            "help": "memory for the prefix cache: keys and values of earlier prompts, so that a request sharing a prefix "
            "with one (a conversation's next turn, a common system prompt) computes only the rest; bytes or "
            "512M, 4G (default: a quarter of the memory available at start-up; 0 turns it off)",
            "parse": parse_size,
            "metavar": "BYTES",
        },
    )
    cache_dir: str | None = field(
        default=None,
        metadata={
            "help": "also keep the prefix cache's blocks in this directory: evicted blocks are read back from it, and a "
            "restarted server finds them (default: RAM only); a new or empty directory, which the cache then "
            "owns: one holding other files is refused",
            "metavar": "DIR",
        },
    )
    cache_disk: int = field(
        default=DEFAULT_CACHE_DISK,
        metadata={
            "help": "most bytes --cache-dir may hold (least recently used blocks are removed first)",
            "parse": parse_size,
            "metavar": "BYTES",
        },
    )
    lora: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "also serve a LoRA fine-tune of this base under a name of its own: requests naming it in `model` "
            "decode through its adapters, in the same batches as the base and other adapters; repeatable",
            "repeatable": True,
            "metavar": "NAME=DIR",
        },
    )
    lora_beside: bool = field(
        default=False,
        metadata={
            "help": "also serve each LoRA directory found beside the base (in the folder that holds it) that was "
            "trained on it, under the directory's name (off by default: whoever can write in that folder would "
            "choose what the server serves)"
        },
    )
    pooling: str = field(
        default="mean",
        metadata={
            "help": "how /v1/embeddings makes one vector of a text's final hidden states: mean (every token) or last "
            "(the last token's)",
            "choices": ("mean", "last"),
        },
    )
    max_context: int | None = field(
        default=None,
        metadata={
            "help": "most tokens (prompt + completion) one request may reach (default: 4 x the model's block_size; "
            "models with learned positions slide a window of block_size past it, others continue, as "
            "`gptkit generate` does)"
        },
    )

    def __post_init__(self) -> None:
        # An empty name would let through a request whose Host header is empty, which the guard exists to refuse.
        blank = next((name for name in self.allowed_host if not name.strip()), None)
        if blank is not None:
            raise GptkitError(
                f"--allowed-host {blank!r} names no host: give a host name such as mybox.lan (loopback "
                "names need no flag)"
            )


def build_app(model_dir: str | Path, options: ServeOptions) -> FastAPI:
    """The app serving model_dir; its engine thread starts and stops with the app."""
    from gptkit.loading import chat_template, load

    _check_options(options)
    kv_dtype = kv_dtype_of(options.kv_cache)  # checked before the (slow) model load
    cache = prefix_cache(options)  # a --cache-dir the cache cannot own is refused before the load, too
    dtype = getattr(torch, options.dtype)
    model, tokenizer = load(model_dir, device=pick_device(options.device), dtype=dtype)  # float or saved-quantised
    served_name = options.model_name or Path(model_dir).resolve().name
    beside = _found_beside(model_dir, options)
    adapters = _adapter_registry(model, options, served_name, bool(beside))  # hashed before quantisation
    if options.quantize is not None and not is_quantized(model):
        model = quantize(model, options.quantize)
    _add_adapters(model, adapters, options, beside)
    if tokenizer is None:
        raise GptkitError(f"{model_dir} has no tokenizer files; the server needs one to read and write text")
    engine = Engine(
        model,
        tokenizer,
        options.max_batch_size,
        options.max_queue,
        options.compile,
        options.max_context,
        kv_dtype,
        cache,
        Lookup(options.lookup_k, options.lookup_ngram),
        options.lookup,
    )
    if options.compile:
        log.info("compiling the decode step for batches of %s rows", engine.batch.row_buckets())
        log.info("compiled in %.1f s", engine.warm_up())
    template = chat_template(model_dir, tokenizer)
    if template.source is None:
        log.info("chat template: gptkit's default ('role: content' turns); the model ships none")
    else:
        log.info("chat template: the model's own (%d characters of Jinja)", len(template.source))
    state = ServerState(
        engine=engine,
        tokenizer=tokenizer,
        model_name=served_name,
        chat_template=template,
        api_key=options.api_key,
        max_body_bytes=options.max_body_bytes,
        allowed_hosts=options.allowed_host if is_loopback(options.host) else None,
        pooling=options.pooling,
        adapters=adapters,
    )
    app = create_app(state)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        if state.templates is not None:
            state.templates.warm()
        try:
            yield
        finally:
            engine.stop()
            if state.templates is not None:
                state.templates.close()

    app.router.lifespan_context = lifespan
    return app


def _check_options(options: ServeOptions) -> None:
    """A one-line error for a setting out of its range, before the (slow) model load."""
    if options.max_body_bytes < 1:
        raise GptkitError(f"--max-body-bytes must be >= 1, got {options.max_body_bytes}")
    Lookup(options.lookup_k, options.lookup_ngram)  # --lookup-k and --lookup-ngram: integers >= 1
    if options.pooling not in POOLINGS:
        raise GptkitError(f"--pooling must be one of {', '.join(POOLINGS)}, got {options.pooling!r}")
    if options.dtype not in DTYPES:
        raise GptkitError(f"--dtype must be one of {', '.join(DTYPES)}, got {options.dtype!r}")
    if options.quantize is not None and options.quantize not in QUANTIZATION_METHODS:
        raise GptkitError(f"--quantize must be one of {', '.join(QUANTIZATION_METHODS)}, got {options.quantize!r}")


def _found_beside(model_dir: str | Path, options: ServeOptions) -> dict[str, Path]:
    """With --lora-beside, the LoRA directories beside the base to serve: none named like a --lora adapter or
    given to one (--lora wins), none at all under --compile (said in a log line)."""
    if not options.lora_beside:
        return {}
    if options.compile:
        log.warning("--lora-beside: not serving adapters found beside the base, since --compile takes none")
        return {}
    names = {spec.partition("=")[0] for spec in options.lora}
    paths = {resolved(spec.partition("=")[2]) for spec in options.lora}
    return {
        name: path
        for name, path in adapters_beside(model_dir).items()
        if name not in names and resolved(path) not in paths
    }


def _add_adapters(model: Any, adapters: AdapterRegistry | None, options: ServeOptions, beside: dict[str, Path]) -> None:
    """Serve each --lora adapter (an error if it cannot be) and each one found beside the base: skipped, in a log
    line, when it is sound but not for this server (it was not asked for); an error when it is damaged."""
    for spec in options.lora:
        name, _, path = spec.partition("=")
        adapters.add(model, name, adapters.read(name, path))
        log.info("serving adapter %r from %s", name, path)
    for name, path in beside.items():
        try:
            adapters.add(model, name, adapters.read(name, path))
        except AdapterMisfit as err:  # trained on another base, or a name a request cannot send
            log.info("not serving %s, found beside the base: %s", path, err)
            continue
        except GptkitError as err:
            raise GptkitError(f"--lora-beside: {err}; repair or move {path}, or leave out --lora-beside") from None
        log.info("serving adapter %r found beside the base (%s)", name, path)


def _adapter_registry(model: Any, options: ServeOptions, name: str, found: bool) -> AdapterRegistry | None:
    """Where served adapters are kept: present when --lora is given, adapters were found beside the base, or
    adapters may be loaded at run time (an API key guards that); None otherwise, sparing the weights' hash."""
    bad = next((spec for spec in options.lora if "=" not in spec), None)
    if bad is not None:
        raise GptkitError(f"--lora {bad!r}: give NAME=DIR, the name requests send as `model` and a LoRA directory")
    if options.lora and options.compile:
        raise GptkitError(
            "--lora cannot be used with --compile: each batch applies its rows' adapters, which a "
            "compiled step cannot follow; leave out --compile"
        )
    if not options.lora and not found and not options.api_key:
        return None
    return AdapterRegistry.for_base(model, name)


def prefix_cache(options: ServeOptions) -> PrefixCache | None:
    """The prefix cache the options ask for (None with --cache-ram 0 and no --cache-dir)."""
    ram = available_memory() // 4 if options.cache_ram is None else options.cache_ram
    if ram < 0 or options.cache_disk < 0:
        raise GptkitError("--cache-ram and --cache-disk must be >= 0 bytes")
    store = None
    if options.cache_dir is not None:
        store = KVStore(options.cache_dir, options.cache_disk)  # made if missing; refused if it holds other files
    if ram == 0 and store is None:
        return None
    log.info(
        "prefix cache: %.1f GiB of RAM%s",
        ram / (1 << 30),
        f", {options.cache_disk / (1 << 30):.1f} GiB in {options.cache_dir}" if store else "",
    )
    return PrefixCache(ram, store)


def default_threads() -> int:
    """Model threads when --threads is not given: at most every core this process may run on, fewer while other
    programs keep cores busy (gptkit.serving.threads). The HTTP side sleeps while a step runs, so leaving it a core
    costs the model that core (GPT-2 small, 2-core EPYC: docs/serve.md, 'On a shared machine', has tokens/s at 1 and 8
    clients with 1 and 2 threads)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def serve(model_dir: str | Path, options: ServeOptions) -> None:
    """Run the server until interrupted."""
    if not 0 <= options.port <= 65535:
        raise GptkitError(f"--port must be in 0..65535, got {options.port}")
    if options.threads is not None and options.threads < 1:
        raise GptkitError(f"--threads must be >= 1, got {options.threads}")
    if not options.head_timeout > 0:
        raise GptkitError(f"--head-timeout must be > 0 seconds, got {options.head_timeout}")
    if options.max_connections < 1:
        raise GptkitError(f"--max-connections must be >= 1, got {options.max_connections}")
    app = _load_on_engine_thread(model_dir, options, options.threads or default_threads())
    announcing_server(uvicorn_config(app, options)).run()


def _load_on_engine_thread(model_dir: str | Path, options: ServeOptions, threads: int) -> FastAPI:
    """build_app on a new thread that then runs the engine's decode loop (Engine.run says why one thread)."""
    loaded: concurrent.futures.Future = concurrent.futures.Future()

    def work() -> None:
        torch.set_num_threads(threads)  # process-wide, so only here and not in build_app
        # A count asked for is kept; else it follows the cores other programs leave free, from before the model
        # loads (the kernels' choices are timed at the count in use).
        governor = ThreadGovernor(threads) if options.threads is None else None
        if governor is not None:
            governor.settle()
        try:
            app = build_app(model_dir, options)
        except BaseException as err:  # noqa: BLE001  (handed to the main thread, which reports it)
            loaded.set_exception(err)
            return
        engine = app.state.gptkit.engine
        engine.governor = governor
        engine.run(ready=lambda: loaded.set_result(app))

    threading.Thread(target=work, name="gptkit-engine", daemon=True).start()
    return loaded.result()


def announcing_server(config: Any) -> Any:
    """A uvicorn server that logs one line once it listens: the URL requests go to (the port the system gave, for
    --port 0)."""
    import uvicorn

    class Announcing(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if self.started and self.servers and self.servers[0].sockets:
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                host = f"[{host}]" if ":" in host else host
                log.info("ready at http://%s:%d/ (the playground; the API under /v1)", host, port)

    return Announcing(config)


def uvicorn_config(app: FastAPI, options: ServeOptions, log_level: str = "info") -> Any:
    """uvicorn's settings for the app: HTTP/1.1 with a deadline on each request head, a cap on connections."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=options.host,
        port=options.port,
        log_level=log_level,
        timeout_graceful_shutdown=5,
        http=head_deadline_protocol(options.head_timeout),
        timeout_keep_alive=options.head_timeout,  # an idle connection: the same deadline
        limit_concurrency=options.max_connections,
    )


def head_deadline_protocol(seconds: float) -> type:
    """uvicorn's h11 protocol with deadlines on what a peer owes (uvicorn itself holds a half-sent request for
    ever): a connection is closed when it sends nothing for `seconds` after connecting or after its last response,
    when a request head, once begun, is not whole within `seconds`, or when a body stalls (no byte for `seconds`;
    each piece of body buys `seconds` more, so a slow upload that keeps moving is not cut)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadDeadline(H11Protocol):
        deadline: asyncio.TimerHandle | None = None
        owes = "request"  # "request": nothing of the next one yet; "head": it has begun; "body": its body is due

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._watch(arrived=False)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch(arrived=True)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self.owes = "request"
            self._watch(arrived=False)

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_watching()
            super().connection_lost(exc)

        def _watch(self, arrived: bool) -> None:
            """Start, restart or stop the deadline for what the peer owes now."""
            state = self.conn.their_state
            if self.transport.is_closing() or state not in (h11.IDLE, h11.SEND_BODY):
                self._stop_watching()  # the request is whole: the app answers it, however long that takes
            elif state is h11.SEND_BODY and (arrived or self.owes != "body"):
                self._restart("body")
            elif state is h11.IDLE and arrived and self.owes == "request":
                self._restart("head")  # a fresh window for the head, once, when its first bytes arrive
            elif self.deadline is None:
                self._restart(self.owes)

        def _restart(self, owes: str) -> None:
            self._stop_watching()
            self.owes = owes
            self.deadline = self.loop.call_later(seconds, self._expire)

        def _stop_watching(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
                self.deadline = None

        def _expire(self) -> None:
            self.deadline = None
            if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
                self.transport.close()

    return HeadDeadline
