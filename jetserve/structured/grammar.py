"""A request's constraint compiled for llguidance, and the matcher that follows its tokens.

`compile_constraint` runs at admission (Orchestrator.submit): a schema, regex or grammar
llguidance cannot compile is refused there with a ValueError naming the request field and
llguidance's message, before the request takes a queue place or a slot. The result,
`TokenGrammar`, lives with the request: it is told each token the request takes
(`advance`, on whichever thread holds the request, one at a time) and writes the mask of
the next one (`fill`).

EOS is in a mask only where the grammar may end (llguidance adds the tokenizer's EOS ids
then); a grammar that can take nothing more allows only EOS, so a complete structure ends
"stop". Near the end of max_tokens the mask is narrowed so the answer closes in time:
json_object by json_budget.py, every other kind by closing.py; a request whose max_tokens
cannot hold even the shortest answer is refused at admission (`check_fits`).
"""

from __future__ import annotations

import json
import logging
import threading

import llguidance
import llguidance.numpy
import numpy as np

from jetserve.request import InvalidArgument
from jetserve.structured.closing import GrammarBudget
from jetserve.structured.constraint import Constraint
from jetserve.structured.json_budget import GrowthTable, JsonBudget
from jetserve.structured.vocabulary import ll_tokenizer

log = logging.getLogger(__name__)

# JSON without optional whitespace: a model cannot pad it with spaces and newlines.
_JSON_OPTIONS = {"whitespace_flexible": False}
# id(LLTokenizer) -> (it, its GrowthTable): built once per vocabulary (LLTokenizer takes
# no weak reference; held here, its id stays its own).
_growth: dict[int, tuple[llguidance.LLTokenizer, GrowthTable]] = {}
_growth_lock = threading.Lock()


def grammar_text(c: Constraint) -> str:
    """The llguidance grammar (its JSON form) of a constraint; ValueError (naming the
    field) when it cannot even be read."""
    try:
        if c.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(c.value, defaults=_JSON_OPTIONS)
        if c.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                                 defaults=_JSON_OPTIONS)
        if c.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(c.value)
        if c.kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(list(c.value)))
        return llguidance.grammar_from("grammar", c.value)  # Lark, or llama.cpp's GBNF
    except (ValueError, TypeError) as e:
        raise ValueError(f"{c.field}: {e}") from None


def check_constraint(c: Constraint, lt: llguidance.LLTokenizer | None = None) -> str:
    """The constraint's grammar, checked (against `lt`'s vocabulary when given; servers
    check without one while parsing a request); ValueError naming `c.field` with
    llguidance's message when it does not compile."""
    grammar = grammar_text(c)
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, lt)
    if failed:
        raise ValueError(f"{c.field}: invalid {c.kind.replace('_', ' ')}: "
                         f"{messages[0].strip()}")
    return grammar


def compile_constraint(c: Constraint, tokenizer, vocab_size: int) -> TokenGrammar:
    """A fresh matcher for one request; ValueError naming `c.field` with llguidance's
    message when the schema / regex / grammar does not compile."""
    lt = ll_tokenizer(tokenizer, vocab_size)
    grammar = check_constraint(c, lt)
    matcher = llguidance.LLMatcher(lt, grammar, log_level=0)
    if matcher.is_error():
        raise ValueError(f"{c.field}: invalid {c.kind.replace('_', ' ')}: "
                         f"{matcher.get_error().strip()}")
    table = _growth_table(lt)
    budget = (JsonBudget(table, vocab_size) if c.kind == "json_object" else
              GrammarBudget(matcher, table, vocab_size, tuple(tokenizer.eos_ids)))
    return TokenGrammar(matcher, c.field, vocab_size, lt.vocab_size, budget)


def _growth_table(lt: llguidance.LLTokenizer) -> GrowthTable:
    with _growth_lock:
        if id(lt) not in _growth:
            table = GrowthTable([lt.decode_bytes([i]) for i in range(lt.vocab_size)])
            _growth[id(lt)] = (lt, table)
        return _growth[id(lt)][1]


class TokenGrammar:
    """One request's grammar state (llguidance.LLMatcher) over the tokens it took."""

    def __init__(self, matcher: llguidance.LLMatcher, field: str, vocab_size: int,
                 ll_vocab_size: int, budget: JsonBudget | GrammarBudget | None = None):
        self.matcher = matcher
        self.budget = budget  # closes within max_tokens (json_budget.py, closing.py)
        self.field = field
        self.vocab_size = vocab_size  # the model's V; llguidance's may be larger (padding)
        self._scratch = llguidance.numpy.allocate_token_bitmask(
            1, max(vocab_size, ll_vocab_size))

    def advance(self, token: int) -> bool:
        """Takes one generated token; False when the grammar refuses it (a token sampled
        without this grammar's mask: a bug, logged) or has nothing more to take."""
        if self.matcher.is_stopped():
            return False
        if not self.matcher.consume_token(int(token)):
            log.warning("%s: the grammar refused token %d: %s", self.field, token,
                        self.matcher.get_error())
            return False
        if self.budget is not None:
            self.budget.take(int(token))
        return True

    def check_fits(self, max_tokens: int) -> None:
        """InvalidArgument naming max_tokens when even the shortest answer this grammar
        allows takes more than `max_tokens` tokens (the request could only be cut)."""
        need = self.budget.minimum() if isinstance(self.budget, GrammarBudget) else None
        if need is not None and need > max_tokens:
            raise InvalidArgument("max_tokens", f"max_tokens: the shortest answer {self.field} "
                                  f"allows takes {need} tokens, and this request may generate "
                                  f"{max_tokens}; give max_tokens of at least {need}")

    @property
    def stopped(self) -> bool:
        """The grammar is complete and takes nothing more (EOS taken, or no token left)."""
        return self.matcher.is_stopped()

    def fill(self, mask: np.ndarray, row: int, remaining: int | None = None) -> None:
        """Writes the next token's allowed set into row `row` of i32[B, W] (W of the
        model's vocabulary); remaining: the tokens the request may still generate, this
        one included: the answer closes within them)."""
        llguidance.numpy.fill_next_token_bitmask(self.matcher, self._scratch, 0)
        mask[row] = self._scratch[0, : mask.shape[1]]
        if self.budget is not None and remaining is not None:
            self.budget.narrow(mask[row], remaining)

    def mask_row(self, remaining: int | None = None) -> np.ndarray:
        """The next token's allowed set as i32[1, W] (a prefill's first token)."""
        mask = llguidance.numpy.allocate_token_bitmask(1, self.vocab_size)
        self.fill(mask, 0, remaining)
        return mask
