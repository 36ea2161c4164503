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
