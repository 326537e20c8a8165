"""vLLM's tokenizer routes, so clients that count or split tokens on the server's side
(lm-eval's remote tokenizer, GuideLLM, vLLM's own tools) work unchanged.

POST /tokenize  {"prompt": str | "messages": [...], "add_special_tokens"?,
                 "add_generation_prompt"?, "tools"?, "chat_template_kwargs"?,
                 "return_token_strs"?}
             -> {"count", "max_model_len", "tokens", "token_strs"}
POST /detokenize {"tokens": [ids]} -> {"prompt": text}
GET /tokenizer_info -> the tokenizer's config (tokenizer_config.json and chat template)

A prompt is tokenized exactly as /v1/completions tokenizes it (BOS as the tokenizer's
config says unless `add_special_tokens` is false), and messages exactly as
/v1/chat/completions renders them. Pure functions over validated bodies; no I/O.
"""

from __future__ import annotations

from typing import Any

from jetserve.server import chat_template, tool_calls
from jetserve.server import validation as v
from jetserve.server.openai_schema import DetokenizeRequest, TokenizeRequest


def _served(model: str | None, served: str) -> None:
    if model is not None and model != served:
        raise v.InvalidArgument("model", f"model {v.show(model)} is not served here; "
                                         f"this server serves {served!r}")


def tokenize(limits: v.ModelLimits, r: TokenizeRequest, served: str) -> dict[str, Any]:
    _served(r.model, served)
    if (r.prompt is None) == (r.messages is None):
        raise v.InvalidArgument("prompt", "give either prompt (a string) or messages")
    if r.prompt is not None:
        # add_special_tokens (default true): BOS as the tokenizer's config says, as a
        # completion prompt gets it; false: none.
        ids = v.encode_text(limits, r.prompt, "prompt",
                            add_bos=False if r.add_special_tokens is False else None)
    else:
        add_gen = True if r.add_generation_prompt is None else r.add_generation_prompt
        plan = tool_calls.plan_tools(r.tools, None)
        ids = chat_template.chat_prompt_ids(
            limits, r.messages, add_gen, tools=plan and plan.tools,
            extra=chat_template.check_template_kwargs(r.chat_template_kwargs))
        if r.add_special_tokens and limits.bos_id is not None and ids[:1] != [limits.bos_id]:
            ids = [limits.bos_id] + ids  # as vLLM: BOS on top of the template's text
    strs = None
    if r.return_token_strs:
        tok = limits.tokenizer
        piece = getattr(tok, "id_to_piece", None)
        strs = [piece(i) if piece is not None else tok.decode([i]) for i in ids]
    return {"count": len(ids), "max_model_len": limits.max_seq_len, "tokens": ids,
            "token_strs": strs}


def detokenize(limits: v.ModelLimits, r: DetokenizeRequest, served: str) -> dict[str, Any]:
    _served(r.model, served)
    if r.tokens is None:
        raise v.InvalidArgument("tokens", "tokens is missing; give a list of token ids")
    ids = v.check_token_ids(limits, r.tokens, "tokens") if r.tokens else []
    if limits.tokenizer is None:
        raise v.InvalidArgument("tokens", "this model has no tokenizer to decode with")
    return {"prompt": limits.tokenizer.decode(ids)}


def tokenizer_info(limits: v.ModelLimits) -> dict[str, Any]:
    """The tokenizer's config as vLLM's /tokenizer_info shows it (no added-token table)."""
    tok = limits.tokenizer
    if tok is None:
        raise v.InvalidArgument("model", "this model has no tokenizer")
    cfg = {k: val for k, val in getattr(tok, "config", {}).items()
           if k != "added_tokens_decoder"}
    cfg.setdefault("tokenizer_class", type(tok).__name__)
    cfg["chat_template"] = getattr(tok, "chat_template", None)
    cfg["bos_token"] = getattr(tok, "bos_token", None)
    cfg["eos_token"] = getattr(tok, "eos_token", None)
    return cfg
