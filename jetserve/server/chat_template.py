"""Chat messages -> prompt token ids, with the model's jinja2 chat template.

The template comes from `tokenizer_config.json` (`chat_template`), or from the
chat_template.jinja that transformers 5 writes beside it, rendered the way transformers'
`apply_chat_template` renders it: a sandboxed jinja2 environment with trim_blocks /
lstrip_blocks, loop controls, the `{% generation %}` block (its body as written),
`raise_exception`, `tojson` (with its indent / separators / sort_keys options) and
`strftime_now`, and the variables `messages`, `add_generation_prompt`, `tools`,
`documents` (None) and the tokenizer's special tokens (`bos_token`, `eos_token`,
`pad_token`, ... as tokenizer_config.json names them). Messages carry an assistant's
`tool_calls` (arguments as objects), its thinking (`reasoning_content`, also as
`thinking`, from whichever of `reasoning_content`, `thinking` or `reasoning` the client
sent, as transformers aliases them) and a tool message's `tool_call_id`; a template that
never mentions tools gets them as text, jetserve.server.tool_calls. A model without a
template gets `DEFAULT_TEMPLATE`. The rendered text already holds any special tokens the
template writes (BOS included), so it is tokenized without adding BOS again.
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Sequence
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from jetserve.server import tool_calls
from jetserve.server.validation import InvalidArgument, ModelLimits, check_text, show
from jetserve.tokenizer import SPECIAL_TOKEN_KEYS

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


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks the assistant's tokens
    with it (for training masks); rendering a prompt writes its body as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body) \
            .set_lineno(lineno)

    def _body(self, caller):
        return caller()


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols",
                                                    _GenerationBlock])
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
                    **(_reasoning(m, where) if role == "assistant" else {}),
                    **tool_calls.message_fields(m, role, where)})
    return out


# The names an assistant's thinking comes under (vLLM's and transformers'), the first the
# one templates read.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _reasoning(m: dict, where: str) -> dict[str, str]:
    """An assistant message's thinking under the names templates read it by, as
    transformers aliases them: {} when it has none."""
    for key in REASONING_FIELDS:
        if m.get(key) is not None:
            text = check_text(m[key], f"{where}.{key}")
            return {"thinking": text, "reasoning_content": text}
    return {}


# What render itself passes: chat_template_kwargs may not set these.
_RESERVED = ("messages", "add_generation_prompt", "tools", "documents", *SPECIAL_TOKEN_KEYS)


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
           tools: list[dict] | None = None, extra: dict[str, Any] | None = None,
           specials: dict[str, str] | None = None) -> str:
    """The conversation as the template writes it; `extra`: chat_template_kwargs;
    `specials`: the tokenizer's other special tokens ({"pad_token": ..., ...})."""
    template = template or DEFAULT_TEMPLATE
    if "tools" not in template and (tools or any("tool_calls" in m for m in messages)):
        messages, tools = tool_calls.as_text(messages, tools), None
    try:
        return _compile(template).render({
            **(extra or {}), **(specials or {}), "messages": messages,
            "add_generation_prompt": add_generation_prompt, "bos_token": bos_token,
            "eos_token": eos_token, "tools": tools or None, "documents": None})
    except _TemplateError as e:  # the template itself rejected the conversation
        raise InvalidArgument("messages", f"messages: the model's chat template says: {e}") \
            from None
    except jinja2.TemplateError as e:
        raise InvalidArgument("messages", f"messages: the chat template failed: {e}") from None


def chat_prompt_text(limits: ModelLimits, messages: Any, add_generation_prompt: bool = True,
                     tools: Sequence[dict] | None = None,
                     extra: dict[str, Any] | None = None) -> str:
    """The conversation as the model's template writes it (chat_prompt_ids' arguments)."""
    tok = limits.tokenizer
    if tok is None:
        raise InvalidArgument("messages", "messages: this model has no tokenizer, so it "
                                          "cannot serve chat; use /v1/completions with ids")
    msgs = normalize_messages(messages)
    return render(msgs, template=getattr(tok, "chat_template", None),
                  bos_token=getattr(tok, "bos_token", None) or "",
                  eos_token=getattr(tok, "eos_token", None) or "",
                  add_generation_prompt=add_generation_prompt,
                  tools=list(tools) if tools else None, extra=extra,
                  specials=getattr(tok, "special_tokens", None))


def chat_prompt_ids(limits: ModelLimits, messages: Any, add_generation_prompt: bool = True,
                    tools: Sequence[dict] | None = None,
                    extra: dict[str, Any] | None = None) -> list[int]:
    """The conversation as prompt token ids, BOS as the template writes it; `tools`: the
    checked definitions (jetserve.server.tool_calls) the template lists; `extra`: the
    checked chat_template_kwargs."""
    text = chat_prompt_text(limits, messages, add_generation_prompt, tools, extra)
    tok = limits.tokenizer
    bos = getattr(tok, "bos_token", None) or ""
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
