"""`trtspec bench-serve`: a load generator for any OpenAI-compatible completions endpoint.

Streaming requests over asyncio + httpx, either closed-loop (C clients, each sending its next
request when its last one has finished) or open-loop (Poisson arrivals at a rate). Per request:
time to first token (first non-empty text chunk), inter-token latency (gap between text chunks
divided by the tokens they carried, counted by the final usage), output tokens, errors.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestRecord:
    ok: bool
    status: int = 0
    error: str = ""
    ttft_s: float = 0.0
    latency_s: float = 0.0
    output_tokens: int = 0
    chunk_gaps: list[float] = field(default_factory=list)  # seconds between text chunks
    chunk_texts: int = 0
    text: str = ""


async def one_request(client, url: str, body: dict, headers: dict) -> RequestRecord:
    t0 = time.perf_counter()
    last = None
    rec = RequestRecord(ok=False)
    pieces = []
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            rec.status = r.status_code
            if r.status_code != 200:
                rec.error = (await r.aread()).decode(errors="replace")[:300]
                rec.latency_s = time.perf_counter() - t0
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                payload = json.loads(data)
                if "error" in payload:
                    rec.error = payload["error"].get("message", "")[:300]
                    return rec
                if payload.get("usage"):
                    rec.output_tokens = payload["usage"]["completion_tokens"]
                for choice in payload.get("choices", []):
                    text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    if text:
                        now = time.perf_counter()
                        if last is None:
                            rec.ttft_s = now - t0
                        else:
                            rec.chunk_gaps.append(now - last)
                        last = now
                        pieces.append(text)
        rec.latency_s = time.perf_counter() - t0
        rec.text = "".join(pieces)
        rec.chunk_texts = len(pieces)
        rec.ok = True
    except Exception as exc:  # noqa: BLE001 - a failed request is a data point, not a crash
        rec.error = f"{type(exc).__name__}: {exc}"[:300]
        rec.latency_s = time.perf_counter() - t0
    return rec


def _body(model, prompt, max_tokens, temperature):
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}}


async def run_load(url: str, model: str, prompts: list[str], *, max_tokens: int, concurrency: int | None = None,
                   rate: float | None = None, num_requests: int, temperature: float = 0.0, api_key: str | None = None,
                   seed: int = 0, timeout: float = 600.0) -> tuple[list[RequestRecord], float]:
    """Send num_requests requests closed-loop at ``concurrency`` or open-loop at ``rate`` per second."""
    import httpx

    endpoint = url.rstrip("/") + "/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    bodies = [_body(model, prompts[i % len(prompts)], max_tokens, temperature) for i in range(num_requests)]
    limits = httpx.Limits(max_connections=max(64, (concurrency or 0) * 2))
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        t0 = time.perf_counter()
        if concurrency is not None:
            queue = iter(range(num_requests))
            records: list[RequestRecord | None] = [None] * num_requests

            async def worker():
                for i in queue:
                    records[i] = await one_request(client, endpoint, bodies[i], headers)

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        else:
            gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=num_requests)
            tasks = []
            for i, gap in enumerate(gaps):
                await asyncio.sleep(gap)
                tasks.append(asyncio.create_task(one_request(client, endpoint, bodies[i], headers)))
            records = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    return list(records), wall


def summarize(records: list[RequestRecord], wall: float) -> dict:
    ok = [r for r in records if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    itl = []
    for r in ok:  # each gap covers the tokens of the chunk it ends; spread evenly over the chunks
        if r.chunk_gaps and r.output_tokens > 1:
            per_chunk = max(1.0, (r.output_tokens - 1) / len(r.chunk_gaps))
            itl += [g / per_chunk for g in r.chunk_gaps]

    def pct(xs, q):
        return float(np.percentile(xs, q) * 1e3) if xs else None

    return {
        "requests": len(records), "errors": len(records) - len(ok),
        "error_examples": sorted({r.error or str(r.status) for r in records if not r.ok})[:3],
        "output_tok_s": tokens / wall if wall else 0.0, "requests_s": len(ok) / wall if wall else 0.0,
        "ttft_p50_ms": pct([r.ttft_s for r in ok], 50), "ttft_p90_ms": pct([r.ttft_s for r in ok], 90),
        "ttft_p99_ms": pct([r.ttft_s for r in ok], 99),
        "itl_p50_ms": pct(itl, 50), "itl_p90_ms": pct(itl, 90), "itl_p99_ms": pct(itl, 99),
        "latency_p50_ms": pct([r.latency_s for r in ok], 50), "wall_s": wall, "output_tokens": tokens,
    }
