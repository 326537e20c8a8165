"""Structured output: what a request's tokens must match (JSON schema, regex, choice,
grammar), and the host-side matchers that turn that into a token mask each step."""

from jetserve.structured.constraint import CONSTRAINT_KINDS, Constraint

__all__ = ["CONSTRAINT_KINDS", "Constraint"]
