"""Chat messages -> prompt token ids, with the model's jinja2 chat template.

The template comes from `tokenizer_config.json` (`chat_template`), rendered the way
Hugging Face renders it: a sandboxed jinja2 environment with trim_blocks / lstrip_blocks,
`raise_exception`, `tojson` and `strftime_now`, and the variables `messages`,
`add_generation_prompt`, `bos_token`, `eos_token` and `tools` (with an assistant's
`tool_calls` and a tool message's `tool_call_id` in the messages; a template that never
mentions tools gets them as text, jetserve.server.tool_calls). A model without a template gets
`DEFAULT_TEMPLATE`. The rendered text already holds any special tokens the template
writes (BOS included), so it is tokenized without adding BOS again.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Sequence
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from jetserve.server import tool_calls
from jetserve.server.validation import InvalidArgument, ModelLimits, check_text, show

# Used when the model ships no template: role-tagged turns, then the assistant's cue.
DEFAULT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

ROLES = ("system", "user", "assistant", "tool", "developer")


class _TemplateError(Exception):
    pass


def _raise(message: str):
    raise _TemplateError(message)


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, separators=None, \
        sort_keys=False: json.dumps(x, indent=indent, ensure_ascii=ensure_ascii,
                                    separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)


def normalize_messages(messages: Any, field: str = "messages") -> list[dict[str, Any]]:
    """Validates OpenAI-style messages; list-of-parts content is joined to one string."""
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument(field, f"{field} must be a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        where = f"{field}[{i}]"
        if not isinstance(m, dict):
            raise InvalidArgument(where, f"{where} must be an object with role and content")
        role = m.get("role")
        if role not in ROLES:
            raise InvalidArgument(f"{where}.role",
                                  f"{where}.role must be one of {list(ROLES)}, got {show(role)}")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise InvalidArgument(
                        f"{where}.content[{j}]",
                        f"{where}.content[{j}] must be a text part "
                        "({'type': 'text', 'text': ...}); other parts are not supported")
                texts.append(check_text(part["text"], f"{where}.content[{j}].text"))
            content = "".join(texts)
        if not isinstance(content, str):
            raise InvalidArgument(f"{where}.content",
                                  f"{where}.content must be a string, got {show(content)}")
        check_text(content, f"{where}.content")  # the tokenizer fails on a lone surrogate
        out.append({"role": role, "content": content,
                    **tool_calls.message_fields(m, role, where)})
    return out


# What render itself passes: chat_template_kwargs may not set these.
_RESERVED = ("messages", "add_generation_prompt", "bos_token", "eos_token", "tools")


def check_template_kwargs(kwargs: Any, field: str = "chat_template_kwargs") -> dict[str, Any]:
    """A request's chat_template_kwargs (vLLM's): an object of more template variables,
    e.g. {"enable_thinking": false}; {} when None."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise InvalidArgument(field, f"{field} must be an object of template variables, "
                                     f"got {show(kwargs)}")
    for k in kwargs:
        if k in _RESERVED:
            raise InvalidArgument(field, f"{field} may not set {k!r}, which the server "
                                         "sets from the request itself")
    return kwargs


def render(messages: list[dict[str, Any]], *, template: str | None, bos_token: str,
           eos_token: str, add_generation_prompt: bool = True,
           tools: list[dict] | None = None, extra: dict[str, Any] | None = None) -> str:
    """The conversation as the template writes it; `extra`: chat_template_kwargs."""
    template = template or DEFAULT_TEMPLATE
    if "tools" not in template and (tools or any("tool_calls" in m for m in messages)):
        messages, tools = tool_calls.as_text(messages, tools), None
    try:
        return _compile(template).render(
            **(extra or {}), messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=bos_token, eos_token=eos_token, tools=tools or None)
    except _TemplateError as e:  # the template itself rejected the conversation
        raise InvalidArgument("messages", f"messages: the model's chat template says: {e}") \
            from None
    except jinja2.TemplateError as e:
        raise InvalidArgument("messages", f"messages: the chat template failed: {e}") from None


def chat_prompt_ids(limits: ModelLimits, messages: Any, add_generation_prompt: bool = True,
                    tools: Sequence[dict] | None = None,
                    extra: dict[str, Any] | None = None) -> list[int]:
    """The conversation as prompt token ids, BOS as the template writes it; `tools`: the
    checked definitions (jetserve.server.tool_calls) the template lists; `extra`: the
    checked chat_template_kwargs."""
    tok = limits.tokenizer
    if tok is None:
        raise InvalidArgument("messages", "messages: this model has no tokenizer, so it "
                                          "cannot serve chat; use /v1/completions with ids")
    msgs = normalize_messages(messages)
    bos = getattr(tok, "bos_token", None) or ""
    eos = getattr(tok, "eos_token", None) or ""
    text = render(msgs, template=getattr(tok, "chat_template", None), bos_token=bos,
                  eos_token=eos, add_generation_prompt=add_generation_prompt,
                  tools=list(tools) if tools else None, extra=extra)
    ids: list[int] = []
    # A BOS written as text is turned into its id: sentencepiece would spell it out.
    if bos and text.startswith(bos) and limits.bos_id is not None:
        ids.append(limits.bos_id)
        text = text[len(bos):]
    if text:
        ids.extend(tok.encode(text, add_bos=False))
    if not ids:
        raise InvalidArgument("messages", "messages: the chat template rendered nothing")
    return ids
