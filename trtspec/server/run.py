"""Running the app under uvicorn: bind, serve, and drain on SIGTERM/SIGINT."""

from __future__ import annotations

import logging

log = logging.getLogger("trtspec.server")


def serve(app, *, host: str = "127.0.0.1", port: int = 8000, drain_timeout: float = 30.0, log_level: str = "warning"):
    """Serve until SIGTERM/SIGINT; then stop admitting (503), let requests in flight finish for up to
    ``drain_timeout`` seconds, cancel what is left, and return (exit code 0)."""
    import uvicorn

    class _DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not app.state.trtspec.draining:
                log.info("signal %s: draining (new requests get 503; up to %.0f s for those in flight)", sig,
                         drain_timeout)
            app.state.trtspec.draining = True
            super().handle_exit(sig, frame)
            # uvicorn re-raises the signal after its graceful shutdown (the process then dies of it); a drained
            # server has done what the signal asked, so it exits 0 instead
            if isinstance(getattr(self, "_captured_signals", None), list):
                self._captured_signals.clear()

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=drain_timeout,
                            access_log=False)
    server = _DrainingServer(config)
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
