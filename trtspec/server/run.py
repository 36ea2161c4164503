"""Running the app under uvicorn: bind, serve, time out slow headers, and drain on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("trtspec.server")

HEADER_TIMEOUT = 10.0  # seconds a connection may take to send a request's headers (trtspec serve --header-timeout)
# the most bytes a connection may send before a request's headers are complete: uvicorn's httptools parser sets
# no bound (h11's, where httptools is missing, is 16 KiB), and a header line of gigabytes sent within the
# timeout would be held in memory
MAX_HEADER_BYTES = 64 << 10
_TOO_LARGE = (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain\r\nconnection: close\r\n"
              b"content-length: 29\r\n\r\nrequest headers over 64 KiB\r\n")


def make_server(app, *, host: str = "127.0.0.1", port: int = 8000, drain_timeout: float = 30.0,
                header_timeout: float = HEADER_TIMEOUT, log_level: str = "warning"):
    """A uvicorn server for ``app`` (create_app's) that drains instead of stopping at once, and closes connections
    that take longer than ``header_timeout`` seconds to send a request's headers (uvicorn itself waits forever:
    a slowloris client holds a connection with a byte now and then) or send more than MAX_HEADER_BYTES of them
    (431). ``server.run()`` serves until SIGTERM/SIGINT or ``server.drain()``; see DrainingServer."""
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol  # httptools' parser where installed, else h11's

    class HeaderTimeoutProtocol(AutoHTTPProtocol):
        """uvicorn's own HTTP protocol with a deadline and a size bound on each request's headers, counted from
        when the connection opens and from when a response completes (a kept-alive connection then waits for its
        next request): past the deadline, or past MAX_HEADER_BYTES (431), the connection is closed. Bytes
        arriving do not put the deadline off."""

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def _arm(self):
            self._header_bytes = 0
            self._header_timer = self.loop.call_later(header_timeout, self._headers_too_slow)

        def _waiting(self) -> bool:
            # a request whose headers are in has a cycle still answering; otherwise the last one is complete
            return self.cycle is None or self.cycle.response_complete

        def _headers_too_slow(self):
            if self._waiting() and not self.transport.is_closing():
                self.transport.close()

        def data_received(self, data):
            waiting = self._waiting()
            super().data_received(data)
            if waiting and self._waiting() and not self.transport.is_closing():  # the headers are still not in
                self._header_bytes += len(data)
                if self._header_bytes > MAX_HEADER_BYTES:
                    self.transport.write(_TOO_LARGE)
                    self.transport.close()

        def on_response_complete(self):
            super().on_response_complete()
            self._header_timer.cancel()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc):
            self._header_timer.cancel()
            super().connection_lost(exc)

    class DrainingServer(uvicorn.Server):
        """SIGTERM/SIGINT (or ``drain()``) drains: the listener stays open and new generations get 503 with
        Retry-After (kept-alive connections too) while those in flight get up to ``drain_timeout`` seconds; the
        ones still running then end detectably (guard.ServerState.drain); then the server stops and ``run`` returns.
        A second signal stops it at once."""

        drain_requested = False

        def drain(self):
            """Begin draining (from any thread)."""
            app.state.trtspec.draining = True
            self.drain_requested = True

        def handle_exit(self, sig, frame):
            if self.drain_requested:  # a second signal: stop now
                self.force_exit = True
                self.should_exit = True
                return
            log.info("signal %s: draining (new requests get 503; up to %.0f s for those in flight)", sig,
                     drain_timeout)
            self.drain()

        async def on_tick(self, counter) -> bool:
            if self.drain_requested and getattr(self, "_draining", None) is None:
                self._draining = asyncio.ensure_future(app.state.trtspec.drain(drain_timeout))
            if getattr(self, "_draining", None) is not None and self._draining.done():
                return True
            return await super().on_tick(counter)

    # nothing is in flight once the drain is over: uvicorn's own graceful wait only closes connections
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                            access_log=False, http=HeaderTimeoutProtocol)
    return DrainingServer(config)


def serve(app, *, host: str = "127.0.0.1", port: int = 8000, drain_timeout: float = 30.0,
          header_timeout: float = HEADER_TIMEOUT, log_level: str = "warning"):
    """Serve until SIGTERM/SIGINT; then drain (make_server) and return (exit code 0)."""
    server = make_server(app, host=host, port=port, drain_timeout=drain_timeout, header_timeout=header_timeout,
                         log_level=log_level)
    server.run()
    if not server.started:
        raise OSError(f"could not serve on {host}:{port} (see the error above)")


def serve_ray(app, *, host: str = "127.0.0.1", port: int = 8000, address: str | None = None,
              metrics_port: int | None = None, direct_ingress: bool = False, name: str = "trtspec"):
    """Run a Serve application (ray_app.build_app) until SIGTERM/SIGINT, then shut it down (Serve lets
    requests in flight finish first).

    ``address``: an existing Ray cluster to join (its head's ``ray start --head``); None starts a local one
    (this process owns it and it ends with it), whose Prometheus endpoint is ``metrics_port``.
    ``direct_ingress``: the ingress replica itself listens on ``host:port`` and Ray's HTTP proxy is not
    started (one process hop less per request; Ray Serve's RAY_SERVE_ENABLE_DIRECT_INGRESS, set before a
    local Ray starts; on a cluster, set it on every ``ray start``)."""
    import os
    import signal
    import sys
    import threading

    import ray
    from ray import serve

    if direct_ingress:
        os.environ.update(RAY_SERVE_ENABLE_DIRECT_INGRESS="1", RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT=str(port),
                          RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT=str(port + 1), RAY_SERVE_DEFAULT_HTTP_HOST=host)
    local = {} if address else {"include_dashboard": False, "_metrics_export_port": metrics_port}
    ray.init(address=address, logging_level="WARNING", log_to_driver=False, **local)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        # with direct ingress Ray still starts its proxy: it gets a spare port, the ingress replica gets ``port``
        serve.start(http_options={"host": host, "port": _spare_port(host) if direct_ingress else port})
        print(f"trtspec serve: starting replicas on Ray ({ray.cluster_resources().get('CPU', 0):.0f} CPUs in the cluster)",
              file=sys.stderr, flush=True)
        serve.run(app, name=name, route_prefix="/")
        print(f"trtspec serve: serving on http://{host}:{port}/v1 (Ray Serve; `serve status` shows the replicas)",
              file=sys.stderr, flush=True)
        stop.wait()
        log.info("shutting down the Ray Serve application")
    finally:
        serve.shutdown()
        ray.shutdown()


def _spare_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
