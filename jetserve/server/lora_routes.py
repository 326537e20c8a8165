"""The HTTP side of LoRA adapters: their cards in /v1/models (with `parent` the base model,
as vLLM lists them) and vLLM's run-time `POST /v1/load_lora_adapter` and
`/v1/unload_lora_adapter` ({"lora_name", "lora_path"}), behind the server's API key
(http_server wraps these handlers as every other route).

Reading and checking an adapter's files runs on a worker thread, so a load never stalls
the event loop that streams other requests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import PlainTextResponse, Response

from jetserve.lora_adapters import Adapters
from jetserve.server import validation as v
from jetserve.server.openai_schema import _Strict


class LoadLoraRequest(_Strict):
    lora_name: str
    lora_path: str


class UnloadLoraRequest(_Strict):
    lora_name: str
    lora_path: str | None = None  # accepted and ignored, as vLLM does


def model_cards(adapters: Adapters, base: dict) -> list[dict]:
    """The base model's card, then one per adapter (`parent`: the base model)."""
    return [base] + [adapter_card(base, name) for name in adapters.names()]


def adapter_card(base: dict, name: str) -> dict:
    return {**base, "id": name, "root": name, "parent": base["id"]}


class LoraRoutes:
    """load / unload handlers over `adapters`; `body(request, model)` parses a body."""

    def __init__(self, adapters: Adapters, body: Callable[[Request, type], Awaitable[Any]]):
        self.adapters = adapters
        self.body = body

    async def load(self, request: Request) -> Response:
        r = await self.body(request, LoadLoraRequest)
        if not r.lora_name:
            raise v.InvalidArgument("lora_name", "lora_name is empty")
        if r.lora_name in self.adapters.names():
            raise v.InvalidArgument("lora_name", f"the LoRA adapter {v.show(r.lora_name)} "
                                                 "is already loaded; unload it first")
        await asyncio.to_thread(self.adapters.load_at_run_time, r.lora_name, r.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{r.lora_name}' added successfully.")

    async def unload(self, request: Request) -> Response:
        r = await self.body(request, UnloadLoraRequest)
        self.adapters.unload(r.lora_name)  # UnknownAdapter: 404
        return PlainTextResponse(f"Success: LoRA adapter '{r.lora_name}' removed "
                                 "successfully.")
