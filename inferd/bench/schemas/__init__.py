"""A corpus of real JSON schemas (README.md beside it says where each came from) and one checker for outputs.

`load_schemas()` gives the entries of schemas.json: `{"name", "source": {"repo", "path", "commit"}, "schema"}`.
`is_valid(schema, text)` says whether `text` is JSON that `schema` accepts, and why not when it isn't. The
benchmark's `--dataset json-schema` draws from the corpus and counts valid outputs with `is_valid`; the
structured-output tests check the engine against it.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jsonschema

from inferd.structured.enforceable import unenforceable

DATA = Path(__file__).parent / "schemas.json"

# The formats worth checking in generated output. jsonschema checks `date`, `email`, `ipv4` and `uuid` with the
# standard library alone; `date-time` needs rfc3339-validator and `uri` needs rfc3987 or rfc3986-validator, which
# are not installed here, so those two are checked only where such a package happens to be present.
WANTED_FORMATS = ("date", "date-time", "email", "uri", "ipv4", "uuid")


@functools.cache
def _format_checker() -> jsonschema.FormatChecker:
    available = jsonschema.FormatChecker.checkers
    return jsonschema.FormatChecker(formats=[f for f in WANTED_FORMATS if f in available])


def checked_formats() -> tuple[str, ...]:
    """The formats `is_valid` checks in this environment."""
    return tuple(sorted(_format_checker().checkers))


@functools.cache
def _text() -> str:
    return DATA.read_text(encoding="utf-8")


def load_schemas() -> list[dict]:
    """Every corpus entry, freshly parsed (callers may mutate what they get)."""
    return json.loads(_text())


def compact(schema) -> str:
    """A schema as compact JSON: the text whose length `small_schemas` bounds."""
    return json.dumps(schema, separators=(",", ":"))


def small_schemas(max_chars: int, entries: list[dict] | None = None) -> list[dict]:
    """The schemas of `entries` (default: the corpus) whose compact text is at most `max_chars` long and whose
    every keyword the mask enforces (the others are refused at admission: `inferd.structured.enforceable`)."""
    return [
        e["schema"]
        for e in (load_schemas() if entries is None else entries)
        if len(compact(e["schema"])) <= max_chars and not unenforceable(e["schema"])
    ]


def extraction_prompt(schema_text: str) -> str:
    """What the benchmark and the lab ask the model for: one JSON object following the schema's text."""
    return f"Write one JSON object that follows this JSON schema.\nSchema: {schema_text}\nJSON:"


def is_valid(schema: dict, text: str) -> tuple[bool, str]:
    """(True, "") when `text` parses as JSON and `schema` accepts it, else (False, the reason).

    The validator class follows the schema's `$schema` (Draft 2020-12 when it names none or an unknown one).
    """
    try:
        instance = json.loads(text)
    except (json.JSONDecodeError, TypeError) as e:
        return False, f"not JSON: {e}"
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    validator = cls(schema, format_checker=_format_checker())
    error = jsonschema.exceptions.best_match(validator.iter_errors(instance))
    if error is None:
        return True, ""
    where = "/".join(str(p) for p in error.absolute_path) or "(root)"
    return False, f"at {where}: {error.message}"
