"""What routers and Kubernetes probes poll besides /health and /metrics.

  - GET /readiness: /health under the name vllm-router and Kubernetes examples use; 200
    when warmed up, 503 while warming up or draining (readiness.py).
  - GET /liveness: 200 while the HTTP loop answers at all. It reads nothing of the
    engine, so a long compile or a busy step never gets a healthy process restarted.
  - GET /get_load: the load the routers' load-aware policies (power_of_two, cache_aware's
    balancing) poll. The two routers read different shapes (ServerConfig.load_format):
    vllm-router `{"load": N}`, N the running + waiting requests; sglang-router SGLang's
    list, one entry per data parallel rank (jetserve serves one) with `num_reqs` (running
    + waiting), `num_waiting_reqs` and `num_tokens`, the KV cache in use in tokens with
    paged KV, else the request count.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from jetserve.server.compat_metrics import request_counts

if TYPE_CHECKING:  # the type only: the servers import no engine code
    from jetserve.orchestrator.driver import Orchestrator


def load(stats: dict, form: str = "vllm-router") -> dict | list[dict]:
    """/get_load's body from orchestrator.stats(), in the shape `form` reads."""
    running, waiting = request_counts(stats)
    if form == "vllm-router":
        return {"load": int(running + waiting)}
    tokens = 0.0
    for r in stats.get("generate") or ():
        if r.get("kv_pages"):
            used = float(r["kv_pages"]) - float(r.get("kv_pages_free") or 0)
            tokens += used * float(r.get("kv_page_size") or 1)
    return [{"dp_rank": 0, "num_reqs": int(running + waiting), "num_waiting_reqs": int(waiting),
             "num_tokens": int(tokens) if tokens else int(running + waiting)}]


def add_routes(app: FastAPI, health: Any, orch: Orchestrator, load_format: str = "vllm-router"
               ) -> None:
    async def liveness() -> Response:
        return JSONResponse({"status": "alive"})

    async def get_load() -> Response:
        return JSONResponse(load(orch.stats(), load_format))

    app.add_api_route("/readiness", health, methods=["GET"])
    app.add_api_route("/liveness", liveness, methods=["GET"])
    app.add_api_route("/get_load", get_load, methods=["GET"])
