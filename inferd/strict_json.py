"""Strict JSON for request bodies: what every HTTP surface of inferd (server, gateway) reads a body with.

Python's `json` reads `NaN`, `Infinity` and `1e309` as floats and `"\\ud800"` as a string holding a lone
surrogate. Neither is valid input: non-finite numbers are not JSON numbers, and a lone surrogate is not
text (a tokenizer cannot read it, and no UTF-8 response can carry it back). `loads` refuses both with an
InvalidRequestError that names the field. The checks cost nothing on ordinary bodies: the parser's number
hooks see only floats, and the (rare) surrogate escape is looked for in the raw bytes before the parsed
body is walked. Malformed JSON raises json.JSONDecodeError, for the caller to word as it does.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from inferd.errors import InvalidRequestError

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def loads(body: bytes) -> Any:
    """The body as JSON; InvalidRequestError for bytes that are not UTF-8, non-finite numbers, lone surrogates."""
    suspect = False

    def number(text: str) -> float:
        nonlocal suspect
        value = float(text)
        suspect = suspect or not math.isfinite(value)
        return value

    try:
        data = json.loads(body, parse_float=number, parse_constant=number)
    except UnicodeDecodeError as e:
        raise InvalidRequestError(f"the request body is not valid UTF-8: {e.reason} at byte {e.start}") from None
    if suspect or _SURROGATE_ESCAPE.search(body):
        bad = find_invalid(data)
        if bad is not None:
            where, what = bad
            raise InvalidRequestError(f"{where or 'the body'} holds {what}", param=where or None)
    return data


def find_invalid(value: Any, path: tuple = ()) -> tuple[str, str] | None:
    """(dotted path, what) of the first lone surrogate or non-finite number in parsed JSON, or None."""
    stack = [(value, path)]
    while stack:
        v, p = stack.pop()
        t = type(v)
        if t is str:
            if not v.isascii() and _has_surrogate(v):
                return ".".join(map(str, p)), "a lone surrogate (text that is not valid Unicode)"
        elif t is float:
            if not math.isfinite(v):
                return ".".join(map(str, p)), f"a non-finite number ({v})"
        elif t is list:
            stack.extend((x, (*p, i)) for i, x in enumerate(v) if type(x) is not int)
        elif t is dict:
            for k, x in v.items():
                if _has_surrogate(k):
                    return ".".join(map(str, p)), "a key with a lone surrogate"
                stack.append((x, (*p, k)))
    return None


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
