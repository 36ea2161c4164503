"""Stage 7: serving. An OpenAI-compatible HTTP server over the continuous-batching scheduler."""

__all__ = ["create_app"]


def __getattr__(name):
    # create_app imports FastAPI: only when it is asked for, so that `import trtspec` (whose serve() lives in
    # server/launch.py) does not pay for it
    if name == "create_app":
        from .app import create_app

        return create_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
