"""`trtspec serve` as a function: the engines behind OpenAI's HTTP API, in this process (uvicorn) or as a Ray Serve
application. Imports FastAPI, uvicorn and Ray only when called."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

from ..errors import AddressInUseError
from .limits import MAX_BODY_BYTES, MAX_QUEUE
from .run import HEADER_TIMEOUT

log = logging.getLogger("trtspec.server")

API_KEY_ENV = "TRTSPEC_API_KEY"  # as vLLM's VLLM_API_KEY and llama-server's LLAMA_API_KEY


def serve(target, draft=None, *, drafter: str | None = None, num_draft_tokens: int = 4, k_policy: str = "load-aware",
          tree_width: int = 1, tree_nodes: int | None = None, threads: int | None = None, max_batch: int | None = None,
          max_queue: int = MAX_QUEUE, max_body_bytes: int = MAX_BODY_BYTES, prefill_chunk: int = 128,
          prefix_cache_mb: float = 256.0, system_prompt: list[str] | None = None, host: str = "127.0.0.1",
          port: int = 8000, api_key: str | None = None, api_key_file: str | os.PathLike | None = None,
          metrics_public: bool = False, parse_special_tokens: bool = False, header_timeout: float = HEADER_TIMEOUT,
          served_model_name: str | None = None, drain_timeout: float = 30.0, log_prompts: bool = False,
          ray: bool = False, replicas: int = 1, autoscale: str | None = None, ray_address: str | None = None,
          router: str = "prefix", ray_metrics_port: int | None = None, direct_ingress: bool = False,
          gpus_per_replica: float = 0.0, datastore: str | os.PathLike | None = None) -> None:
    """Serve ``target`` (and ``draft``) over OpenAI's HTTP API until SIGTERM/SIGINT; ``trtspec serve`` is this call
    (see `trtspec serve --help` for each option). ``system_prompt``: texts whose KV is computed at start and kept;
    the API key: ``api_key``, else the keys of ``api_key_file``, else $TRTSPEC_API_KEY, else none. ``ray``: a Ray
    Serve application (``replicas`` or ``autoscale`` "MIN:MAX", ``router``, ...) instead of one process.
    ``datastore``: an index (``trtspec index``) that suffix decoding drafts from, mapped once and shared by every
    request (each Ray replica maps the same file: the pages are shared too)."""
    keys = api_keys(api_key, api_key_file)
    if not (ray and ray_address):  # joining a running Ray cluster: its Serve proxy may hold the port already, rightly
        check_address(host, port)  # before the engines load: a taken port is known at once, not a minute later
    if ray:
        return _serve_ray(target, draft, drafter=drafter, num_draft_tokens=num_draft_tokens, k_policy=k_policy,
                          max_batch=max_batch, prefill_chunk=prefill_chunk, prefix_cache_mb=prefix_cache_mb,
                          num_threads=threads or 1, router=router, tree_width=tree_width, tree_nodes=tree_nodes,
                          max_queue=max_queue, gpus_per_replica=gpus_per_replica, system_prompts=system_prompt,
                          model_name=served_model_name, api_key=keys, log_prompts=log_prompts, replicas=replicas,
                          max_body_bytes=max_body_bytes, metrics_public=metrics_public,
                          parse_special_tokens=parse_special_tokens, autoscale=autoscale, host=host, port=port,
                          address=ray_address, metrics_port=ray_metrics_port, direct_ingress=direct_ingress,
                          datastore=os.path.abspath(datastore) if datastore else None)
    from ..runtime import Scheduler
    from .app import create_app
    from .run import serve as run_server

    scheduler = Scheduler(target, draft, drafter=drafter, num_draft_tokens=num_draft_tokens, k_policy=k_policy,
                          max_batch=max_batch, prefill_chunk=prefill_chunk, prefix_cache_mb=prefix_cache_mb,
                          num_threads=threads, tree_width=tree_width, tree_nodes=tree_nodes, datastore=datastore)
    for text in system_prompt or ():
        log.info("cached a prefix of %d tokens", scheduler.register_prefix(text))
    name = served_model_name or Path(target).resolve().name
    app = create_app(scheduler, model_name=name, api_key=keys, max_queue=max_queue, max_body_bytes=max_body_bytes,
                     metrics_public=metrics_public, parse_special_tokens=parse_special_tokens, log_prompts=log_prompts)
    log.info("serving %s on http://%s:%d/v1 (max batch %d, capacity %d tokens)", name, host, port,
             scheduler.max_batch, scheduler.capacity)
    run_server(app, host=host, port=port, drain_timeout=drain_timeout, header_timeout=header_timeout)


def check_address(host: str, port: int) -> None:
    """Refuse a host:port this process cannot listen on (another server has it, or the host is not this machine's),
    saying which and what to do. The probe binds as the server does (SO_REUSEADDR) and closes at once."""
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise AddressInUseError(f"cannot serve on {host}:{port}: {exc.strerror}; pass --host with a name or address "
                                "of this machine (127.0.0.1: this machine only; 0.0.0.0: every interface)") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            taken = exc.errno == errno.EADDRINUSE
            raise AddressInUseError(
                f"cannot serve on {host}:{port}: {exc.strerror}; "
                + ("another process listens there (another trtspec serve?): stop it, or pass --port with a free port"
                   if taken else "pass --host with an address of this machine, or a --port this user may open")
            ) from None


def api_keys(api_key: str | None, api_key_file: str | os.PathLike | None) -> list[str] | None:
    """The API keys the server requires: ``api_key``, the keys of ``api_key_file`` (one a line, # starts a comment),
    else $TRTSPEC_API_KEY; None: no key."""
    if api_key is not None:
        return [api_key]
    if api_key_file is not None:
        try:
            lines = Path(api_key_file).read_text().splitlines()
        except OSError as exc:
            raise ValueError(f"cannot read the API key file: {exc}") from None
        keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not keys:
            raise ValueError(f"no API key in {api_key_file} (one key a line; # starts a comment)")
        return keys
    key = os.environ.get(API_KEY_ENV, "").strip()
    return [key] if key else None


def _serve_ray(target, draft, *, autoscale: str | None, host: str, port: int, address: str | None,
               metrics_port: int | None, direct_ingress: bool, **config) -> None:
    """serve(ray=True): ``config`` is ray_app.build_app's."""
    from .ray_app import build_app  # an ImportError that says how to install Ray Serve where it is missing
    from .run import serve_ray

    if autoscale:
        try:
            low, high = (int(x) for x in autoscale.split(":"))
        except ValueError:
            low = high = -1
        if not (0 <= low <= high and high >= 1):
            raise ValueError(f"autoscale wants MIN:MAX with 0 <= MIN <= MAX, MAX >= 1; got {autoscale!r}")
        config["autoscale"] = {"min_replicas": low, "max_replicas": high, "initial_replicas": max(low, 1)}
    app = build_app({"target": target, "draft": draft, **config})
    serve_ray(app, host=host, port=port, address=address, metrics_port=metrics_port, direct_ingress=direct_ingress)
