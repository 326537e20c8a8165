"""A reasoning model's thinking, split from its answer: the formats `--reasoning-parser`
names (vLLM's names).

- deepseek_r1: `<think>...</think>` then the answer. The chat templates of DeepSeek-R1
  (and QwQ) open `<think>` in the prompt, so the output may start inside the thinking
  (an opening `<think>` of its own is dropped); everything up to `</think>` is reasoning,
  and an output that never writes `</think>` is all reasoning.
- qwen3, glm45: thinking only when the output opens with `<think>` (leading whitespace
  aside); it runs to `</think>`, or to the end of an output cut before it. Without
  `<think>` the output is all answer (Qwen3 with `enable_thinking: false`: its template
  writes an empty `<think></think>` into the prompt instead).

A request's `chat_template_kwargs` `{"enable_thinking": false}` (or `"thinking": false`)
says the model does not think: the whole output is the answer, whatever the parser.
Reasoning is never read for tool calls: only the answer goes on to the tool-call reader.
gpt-oss's harmony format keeps its thinking in the analysis channel (jetserve.server.harmony).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jetserve.server.held_text import partial


@dataclasses.dataclass(frozen=True, kw_only=True)
class ThinkFormat:
    """Where the thinking is.

    Args:
      start, end: the markers around it.
      starts_inside: the prompt already opened it, so the output begins in it.
    """

    start: str = "<think>"
    end: str = "</think>"
    starts_inside: bool = False


PARSERS = {
    "deepseek_r1": ThinkFormat(starts_inside=True),
    "qwen3": ThinkFormat(),
    "glm45": ThinkFormat(),
}
HARMONY = "openai_gptoss"  # vLLM's name: gpt-oss's analysis channel (jetserve.server.harmony)
NAMES = (*PARSERS, HARMONY)


def check_parser(name: str | None, field: str = "--reasoning-parser") -> str | None:
    """`name` if it names a parser (None: none); else ValueError naming `field`."""
    if name is not None and name not in NAMES:
        raise ValueError(f"{field} must be one of {', '.join(NAMES)}, got {name!r}")
    return name


def thinking_on(kwargs: dict[str, Any] | None) -> bool:
    """False when chat_template_kwargs turn thinking off (enable_thinking / thinking)."""
    kwargs = kwargs or {}
    return all(kwargs.get(k) is not False for k in ("enable_thinking", "thinking"))


class ThinkSplitter:
    """One choice's text, as it streams, split into (reasoning, answer) pieces.

    A piece that may be the start of a marker is held back until the next text (or
    `finish`) says what it is.
    """

    def __init__(self, fmt: ThinkFormat):
        self.fmt = fmt
        self.state = "inside" if fmt.starts_inside else "before"
        self.buf = ""
        self.opened = False  # the thinking's start was seen (or assumed)
        self.lead = False  # whitespace after the thinking's end is dropped

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        return self._run(final=False)

    def finish(self) -> tuple[str, str]:
        return self._run(final=True)

    def _run(self, final: bool) -> tuple[str, str]:
        reasoning, answer = [], []
        while True:
            if self.state == "answer":
                if self.lead:
                    self.buf = self.buf.lstrip()
                    self.lead = not self.buf
                answer.append(self.buf)
                self.buf = ""
                break
            s = self.buf.lstrip()
            if self.state in ("before", "inside") and not self.opened:
                if s.startswith(self.fmt.start):  # the output opens the thinking itself
                    self.buf, self.opened, self.state = s[len(self.fmt.start):], True, "inside"
                    continue
                if not final and self.fmt.start.startswith(s):
                    break  # still could be the start marker (or only whitespace so far)
                if self.state == "before":
                    self.state = "answer"
                    continue
                self.opened = True  # deepseek_r1: thinking from the first character
            k = self.buf.find(self.fmt.end)
            if k >= 0:
                reasoning.append(self.buf[:k])
                self.buf, self.state = self.buf[k + len(self.fmt.end):], "answer"
                self.lead = True
                continue
            keep = 0 if final else partial(self.buf, self.fmt.end)
            reasoning.append(self.buf[:len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep:]
            break
        return "".join(reasoning), "".join(answer)


def split(fmt: ThinkFormat, text: str) -> tuple[str, str]:
    """A whole output's (reasoning, answer)."""
    s = ThinkSplitter(fmt)
    r1, a1 = s.feed(text)
    r2, a2 = s.finish()
    return r1 + r2, a1 + a2
