"""What a user would otherwise write: HF transformers generate() behind a minimal FastAPI endpoint.

One request at a time (a lock around generate), streamed with TextIteratorStreamer, greedy or sampled,
speaking just enough of OpenAI's /v1/completions for `trtspec bench-serve`.

    python benchmarks/hf_server.py --model models/stdlib-target --port 8100 [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import uuid

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from transformers import AutoModelForCausalLM, AutoTokenizer, TextIteratorStreamer


def make_app(model_dir: str, name: str) -> FastAPI:
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    lock = threading.Lock()
    app = FastAPI()

    @app.get("/health")
    def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": name, "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        ids = tok(body["prompt"], return_tensors="pt")["input_ids"]
        max_new = int(body.get("max_tokens", 16))
        temperature = float(body.get("temperature", 1.0))
        streamer = TextIteratorStreamer(tok, skip_prompt=True, skip_special_tokens=True)
        counted = {}

        def work():
            with lock, torch.no_grad():
                kw = dict(do_sample=True, temperature=temperature) if temperature > 0 else dict(do_sample=False)
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                                     streamer=streamer, pad_token_id=tok.pad_token_id or 0, **kw)
                counted["n"] = out.shape[1] - ids.shape[1]

        worker = threading.Thread(target=work, daemon=True)
        worker.start()
        rid, created = f"cmpl-{uuid.uuid4().hex[:16]}", int(time.time())

        def chunk(text, finish=None, usage=None):
            payload = {"id": rid, "object": "text_completion", "created": created, "model": name,
                       "choices": [] if usage else [{"index": 0, "text": text, "finish_reason": finish}]}
            if usage:
                payload["usage"] = usage
            return f"data: {json.dumps(payload)}\n\n"

        def events():
            for text in streamer:  # blocks a threadpool thread, not the event loop
                if text:
                    yield chunk(text)
            yield chunk("", "stop")
            worker.join()
            n = counted.get("n", 0)
            yield chunk("", usage={"prompt_tokens": ids.shape[1], "completion_tokens": n,
                                   "total_tokens": ids.shape[1] + n})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--name", default="hf")
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    uvicorn.run(make_app(args.model, args.name), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
