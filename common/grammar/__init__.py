"""Structured output: grammars compiled off the loops, matchers, and the batched token mask."""
