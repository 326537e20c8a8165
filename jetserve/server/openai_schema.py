"""Request bodies of the OpenAI-compatible HTTP API, validated strictly.

Strict pydantic models: a string where a number belongs, a float where an integer
belongs or a bool where a number belongs is an error naming the field (OpenAI clients
send JSON numbers, so nothing real is lost). Fields not modelled here are kept aside
(`model_extra`): OpenAI fields that would change the answer and that jetserve does not
implement are refused by name (structured_fields.UNIMPLEMENTED); others are ignored, as
OpenAI-style clients send many with no bearing on the output (`user`, `metadata`, ...).
Values are range-checked later, against the model's limits (jetserve.server.validation).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from jetserve.server.validation import InvalidArgument, check_json_depth, show


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # extension (vLLM): usage on every chunk


class _Sampling(_Strict):
    """Fields both endpoints share. None means "the default": the model's (its
    generation_config.json), else OpenAI's (jetserve.server.openai_format)."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension (vLLM-style); -1 or 0: off
    min_p: float | None = None  # extension
    repetition_penalty: float | None = None  # extension
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension
    ignore_eos: bool | None = None  # extension
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, Any] | None = None  # token id -> bias (validation.logit_bias_pairs)
    return_tokens_as_token_ids: bool | None = None  # extension (vLLM): "token_id:N"
    # Structured output (jetserve.server.structured_fields checks their shapes).
    response_format: Any = None
    structured_outputs: Any = None  # extension (vLLM)
    guided_json: Any = None  # extension (vLLM, older)
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None


class CompletionRequest(_Sampling):
    # str | list[str] | list[int] | list[list[int]]; shapes are checked by prompt_list.
    prompt: Any = None
    max_tokens: int | None = None  # None: the model's default, else 16 (as OpenAI)
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


class ChatRequest(_Sampling):
    messages: Any = None  # checked by chat_template.normalize_messages
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = None  # extension (as vLLM)
    tools: Any = None  # checked by tool_calls.plan_tools, as is tool_choice
    tool_choice: Any = None
    parallel_tool_calls: Any = None  # checked by tool_calls.plan_tools
    chat_template_kwargs: Any = None  # extension (vLLM): more variables for the template


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a `prompt`, or chat `messages` rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: Any = None
    tools: Any = None  # with messages: listed by the chat template, as chat does
    chat_template_kwargs: Any = None  # with messages: more template variables, as chat
    add_special_tokens: bool | None = None  # BOS; default: True for prompt, False for chat
    add_generation_prompt: bool | None = None
    return_token_strs: bool | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int] | None = None


def parse_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or InvalidArgument saying what is wrong."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidArgument("body", f"body is not valid UTF-8 (byte {e.start}: "
                                      f"{raw[e.start:e.start + 1]!r})") from None
    if not text.strip():
        raise InvalidArgument("body", "body is empty; send a JSON object")
    check_json_depth(raw)  # json.loads recurses per level
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidArgument("body", f"body is not valid JSON: {e}") from None
    except ValueError:  # an integer longer than int() converts (4,300 digits)
        raise InvalidArgument("body", "body has a number with too many digits to read; "
                                      "send numbers as the fields' ranges allow") from None
    if not isinstance(body, dict):
        raise InvalidArgument("body", f"body must be a JSON object, got {type(body).__name__}")
    return body


def validate(model: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        # A location can hold a client's dict key: cut and escaped like a value.
        loc = [p if isinstance(p, int) or (len(p) <= 64 and p.isprintable()) else show(p, 64)
               for p in err["loc"] if not _is_type_tag(p)]
        field = ".".join(map(str, loc)) or "body"
        value = show(err.get("input"))
        raise InvalidArgument(field, f"{field}: {err['msg'].lower()}, got {value}") from None


def _is_type_tag(p: Any) -> bool:
    # Union members appear in error locations as e.g. 'list[str]' or 'str'.
    return isinstance(p, str) and (p in ("str", "int", "float", "bool") or "[" in p)


def prompt_list(prompt: Any) -> list[str | list[int]]:
    """`prompt` as a list of prompts, each a string or a list of token ids."""
    if prompt is None:
        raise InvalidArgument("prompt", "prompt is missing")
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list):
        raise InvalidArgument("prompt", "prompt must be a string, a list of strings, a list "
                                        f"of token ids or a list of such lists, "
                                        f"got {show(prompt)}")
    if not prompt:
        raise InvalidArgument("prompt", "prompt is an empty list")
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return [prompt]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) for p in prompt):
        return list(prompt)
    raise InvalidArgument("prompt", "prompt mixes kinds: give strings, token ids, or lists "
                                    "of token ids, not a mixture")
