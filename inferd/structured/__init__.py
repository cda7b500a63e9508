"""Structured generation: constraints on what a request may sample (schemas, regexes, grammars, tools)."""
