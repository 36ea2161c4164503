"""Stage 7: serving. An OpenAI-compatible HTTP server over the continuous-batching scheduler."""

from .app import create_app

__all__ = ["create_app"]
