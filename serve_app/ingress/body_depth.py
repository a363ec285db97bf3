"""How deep a JSON request body nests, found before it is parsed (the RequestGate's 400).

Python's json parser recurses once per level and pydantic's serializer and Ray's pickler have
their own recursion limits, so a small body nested a few hundred levels deep used to be stored and
then fail every read (issue 36). The gate refuses any body nested deeper than `max_json_depth`
before anything parses it, naming where: `metadata.a.0.0` (the path is found by a scan bounded to
the first SCAN_TOKENS tokens; past them the message names no field).

The depth itself is found at C speed whatever the body: strings are blanked by one regular
expression that cannot backtrack (an unterminated string runs to the end instead of failing), then
numpy's cumulative sum of +1 per `[`/`{` and -1 per `]`/`}` gives every byte's depth. A
hand-written scan rather than a library: no JSON library in the environment bounds depth below
its own recursion limit, nor says where a limit was crossed.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

# A string: its quote, then runs without quote or backslash, or escaped pairs; a string the body
# leaves open runs to its end (so a failed match never restarts from every later quote).
_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+(?:"|\\?\Z)', re.DOTALL)
_STEP = np.zeros(256, dtype=np.int8)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1
_TOKEN = re.compile(rb'"(?:[^"\\]++|\\.)*+"|[\[\]{},:]', re.DOTALL)
SCAN_TOKENS = 200_000
SHOWN_LEVELS = 4


def too_deep(body: bytes, limit: int) -> tuple[int, str | None] | None:
    """None when `body` nests at most `limit` arrays and objects deep; else (limit + 1 or more: the
    depth reached, the dotted path where it first passed `limit`, or None when not found cheaply)."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return None  # cannot be deeper: the common case, two C scans
    blanked = _STRING.sub(lambda m: b"  " if m.group().endswith(b'"') else b"", body)
    depth = np.cumsum(_STEP[np.frombuffer(blanked, dtype=np.uint8)], dtype=np.int32)
    deepest = int(depth.max(initial=0))
    if deepest <= limit:
        return None
    return deepest, _path_to_depth(body, limit + 1)


def _path_to_depth(body: bytes, depth: int) -> str | None:
    """The dotted path of the first container at `depth` (keys, and indexes of arrays), or None
    when it is not within the first SCAN_TOKENS tokens (or the body is not JSON enough to say)."""
    frames: list[list[Any]] = []  # per open container: [is_object, its current key or index, expecting a key]
    for n, token in enumerate(_TOKEN.finditer(body)):
        if n >= SCAN_TOKENS:
            return None
        text = token.group()
        if text in (b"[", b"{"):
            if len(frames) + 1 >= depth:
                return _dotted([frame[1] for frame in frames])
            frames.append([text == b"{", "" if text == b"{" else 0, text == b"{"])
        elif text in (b"]", b"}"):
            if not frames:
                return None
            frames.pop()
        elif text == b"," and frames:
            frame = frames[-1]
            if frame[0]:
                frame[2] = True
            else:
                frame[1] += 1
        elif text.startswith(b'"') and frames and frames[-1][0] and frames[-1][2]:
            try:
                frames[-1][1] = json.loads(text)
            except ValueError:
                frames[-1][1] = "?"
            frames[-1][2] = False
    return None


def _dotted(path: list[Any]) -> str:
    shown = [str(part) for part in path[:SHOWN_LEVELS]]
    return ".".join(shown) + (".…" if len(path) > SHOWN_LEVELS else "")
