"""The server's default bounds, importable without FastAPI (the command line's defaults are these)."""

MAX_QUEUE = 256  # requests waiting beyond the free rows before new ones get 429 (trtspec serve --max-queue)
MAX_BODY_BYTES = 4 << 20  # the largest request body read (trtspec serve --max-body-bytes): 413 beyond
