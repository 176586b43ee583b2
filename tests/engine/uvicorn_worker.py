"""An SGLang-shaped PD worker served by uvicorn, the server SGLang itself runs on (a plain ASGI app).

What matters here is uvicorn's HTTP behaviour, not the engine: keep-alive connections closed after
``--keepalive`` seconds idle (SGLang: ``SGLANG_TIMEOUT_KEEP_ALIVE``, 5 s), its framing and its timing.
Both roles answer generation routes at once (prefill: one token; decode: ``max_tokens`` of them, as JSON or
SSE), plus ``/health``, ``/server_info``, ``/v1/loads`` and ``/abort_request``.

    python -m tests.engine.uvicorn_worker --role decode --port 30020 --keepalive 0.2
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import uvicorn

Scope = dict[str, Any]


def make_app(role: str) -> Any:
    async def app(scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        path = scope["path"]
        if path in ("/generate", "/v1/chat/completions", "/v1/completions"):
            req = json.loads(body or b"{}")
            n = 1 if role == "prefill" else int(req.get("max_tokens") or (req.get("sampling_params") or {}).get(
                "max_new_tokens", 4))
            if req.get("stream"):
                await send({"type": "http.response.start", "status": 200,
                            "headers": [(b"content-type", b"text/event-stream")]})
                for i in range(n):
                    ev = {"id": req.get("rid"), "object": "chat.completion.chunk",
                          "choices": [{"index": 0, "delta": {"content": f" t{i}"}, "finish_reason": None}]}
                    await send({"type": "http.response.body", "body": b"data: " + json.dumps(ev).encode() + b"\n\n",
                                "more_body": True})
                await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
                return
            text = " ".join(f"t{i}" for i in range(n))
            out: Any = {"id": req.get("rid"), "object": "chat.completion", "model": "uv-model",
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                     "finish_reason": "length"}],
                        "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}}
        elif path == "/server_info":
            out = {"served_model_name": "uv-model", "disaggregation_mode": role, "version": "0.5.23-uvicorn"}
        elif path == "/v1/loads":
            out = {"loads": [{"dp_rank": 0, "num_running_reqs": 0, "num_waiting_reqs": 0}]}
        elif path in ("/health", "/abort_request"):
            out = None
        else:
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        data = b"" if out is None else json.dumps(out).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": data})

    return app


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--role", choices=("prefill", "decode"), required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--keepalive", type=float, default=5.0)
    a = p.parse_args()
    uvicorn.run(make_app(a.role), host="127.0.0.1", port=a.port, timeout_keep_alive=a.keepalive,  # type: ignore[arg-type]
                log_level="warning", lifespan="off")


if __name__ == "__main__":
    main()
