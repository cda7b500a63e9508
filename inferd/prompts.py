"""OpenAI's four `prompt` shapes (a string, strings, token ids, lists of token ids) as one pydantic type, and
the 400 a request gets when it fails a pydantic type.

The server's request model and the gateway both validate prompts with `Prompt`, so the two accept exactly
the same prompts and name the same field in their errors: `prompt`, or `prompt.3` for the element at fault;
`prompt_items` is how the server, the gateway and the Ray ingress read a checked prompt as its prompts.
A token id is an integer in [0, 2^63), what the engine and the prefix cache's keys (`inferd.prefix_hash`)
hold. The gateway cannot import `inferd.server` (it runs without the engine), so these live here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import Discriminator, Field, Tag, TypeAdapter, ValidationError

from inferd.errors import InvalidRequestError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]


def _prompt_kind(value: Any) -> str:
    """Which of OpenAI's four prompt shapes `value` is, from its first element: validating a long list against
    every shape in turn would cost as much as the request."""
    if isinstance(value, str):
        return "str"
    if isinstance(value, list) and value:
        if isinstance(value[0], str):
            return "list[str]"
        if isinstance(value[0], list):
            return "list[list[int]]"
    return "list[int]"


#: names pydantic puts in an error's location for the prompt's shape; the client never wrote them
UNION_TAGS = frozenset({"str", "list[str]", "list[int]", "list[list[int]]"})

Prompt = Annotated[
    Annotated[str, Tag("str")]
    | Annotated[list[str], Tag("list[str]"), Field(min_length=1)]
    | Annotated[list[TokenId], Tag("list[int]"), Field(min_length=1)]
    | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Tag("list[list[int]]"), Field(min_length=1)],
    Discriminator(_prompt_kind),
]

_PROMPT = TypeAdapter(Prompt)


def error_param(loc: Sequence) -> str | None:
    """A pydantic error location as OpenAI's `param` ("prompt.1"): without "body" and the union's tags."""
    return ".".join(str(x) for x in loc if x != "body" and x not in UNION_TAGS) or None


def invalid_request(errors: Sequence[dict], prefix: Sequence = ()) -> InvalidRequestError:
    """pydantic's errors as one 400: every field at fault (the first ten) in the message, the first as `param`."""
    params = [error_param((*prefix, *e.get("loc", ()))) for e in errors[:10]]
    details = "; ".join(f"{p or 'body'}: {e.get('msg')}" for p, e in zip(params, errors, strict=False))
    if len(errors) > 10:
        details += f"; and {len(errors) - 10} more"
    return InvalidRequestError(f"invalid request: {details}", param=params[0] if params else None)


def prompt_items(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """A prompt of one of the four shapes (as `check_prompt` returns it) as the list of prompts it is: a string
    or one list of token ids is one prompt."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


def check_prompt(value: Any) -> str | list[str] | list[int] | list[list[int]]:
    """`value` as one of the four shapes (as the server reads it: `[1.0]` is `[1]`); InvalidRequestError
    naming `prompt` or the element at fault otherwise."""
    try:
        return _PROMPT.validate_python(value)
    except ValidationError as e:
        raise invalid_request(e.errors(), prefix=("prompt",)) from None
