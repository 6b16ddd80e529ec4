"""The prompts file of ``dmi capture``: JSON lines, checked line by line."""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from .exits import UsageError


@dataclass
class Prompt:
    id: str
    text: str
    line: int
    auto: bool = False      # the id was made up (p<N>), not given in the file


def read_prompts(path: str | Path) -> list[Prompt]:
    """Prompts from a JSON-lines file: one object per line with "prompt" and an optional "id".

    Blank lines and lines starting with '#' are skipped. Default ids are p0, p1, ... (the prompt's
    index in the file). Every problem raises :class:`UsageError` naming the file and the line.
    """
    name = str(path)
    if name == "-":
        text, name = sys.stdin.read(), "<stdin>"
    else:
        p = Path(path)
        if not p.exists():
            raise UsageError(f"{name}: prompts file does not exist. Fix: check the path, or leave --prompts out "
                             f"to use the packaged example")
        if p.is_dir():
            raise UsageError(f"{name}: is a directory, not a prompts file. Fix: pass a .jsonl file")
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"{name}: cannot be read: {e}. Fix: pass a UTF-8 JSON-lines file") from None
    out: list[Prompt] = []
    seen: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{name}:{lineno}: not valid JSON ({e.msg} at column {e.colno}). "
                             f'Fix: write one JSON object per line, e.g. {{"id": "a", "prompt": "Hello"}}') from None
        if not isinstance(obj, dict):
            raise UsageError(f"{name}:{lineno}: expected a JSON object, got {type(obj).__name__}. "
                             f'Fix: write {{"prompt": "..."}} on each line')
        if "prompt" not in obj:
            raise UsageError(f"{name}:{lineno}: missing \"prompt\" (keys: {', '.join(map(repr, obj)) or 'none'}). "
                             f'Fix: add "prompt": "<text>" to this line')
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise UsageError(f"{name}:{lineno}: \"prompt\" must be a non-empty string. Fix: quote the prompt text")
        rid = obj.get("id", f"p{len(out)}")
        if isinstance(rid, bool) or not isinstance(rid, (str, int)) or str(rid) == "":
            raise UsageError(f"{name}:{lineno}: \"id\" must be a non-empty string or an integer, got {rid!r}. "
                             f"Fix: use a string id, or leave \"id\" out for p0, p1, ...")
        rid = str(rid)
        if rid in seen:
            raise UsageError(f"{name}:{lineno}: id {rid!r} is already used on line {seen[rid]}. "
                             f"Fix: give every prompt a unique id")
        seen[rid] = lineno
        out.append(Prompt(rid, obj["prompt"], lineno, auto="id" not in obj))
    if not out:
        raise UsageError(f"{name}: no prompts. Fix: write one JSON object per line, e.g. "
                         f'{{"id": "a", "prompt": "Hello"}}')
    return out
