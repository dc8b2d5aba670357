"""The text shipped with the package (SOURCES.md): four kinds, each with a calibration part (what
a compression calibrates on when --calib is not given) and a held-out judging part (what a lossy
conversion's perplexity is judged on), cut from different documents."""

from __future__ import annotations

import json
from pathlib import Path

#: The kinds of text, in the order the mixed calibration takes their windows.
KINDS = ("fiction", "technical", "code", "dialogue")
PARTS = ("calib", "held_out")
ROOT = Path(__file__).resolve().parent


def shipped_kind(part) -> str | None:
    """The shipped kind a --calib value names (a kind's name, where no file of that name exists), or None."""
    return str(part) if str(part) in KINDS and not Path(part).exists() else None


def kind_documents(kind: str, part: str, tokenizer=None) -> list[str]:
    """The documents of one kind's part: a text file is one document; dialogue is one document per
    conversation, in `tokenizer`'s chat template when it has one (else "User:"/"Assistant:" lines)."""
    if kind not in KINDS or part not in PARTS:
        raise ValueError(f"no shipped text {part}/{kind}; kinds: {', '.join(KINDS)}, parts: {', '.join(PARTS)}")
    if kind != "dialogue":
        return [(ROOT / part / f"{kind}.txt").read_text(encoding="utf-8")]
    lines = (ROOT / part / "dialogue.jsonl").read_text(encoding="utf-8").splitlines()
    return [render_conversation(json.loads(line)["turns"], tokenizer) for line in lines if line.strip()]


def render_conversation(turns: list[str], tokenizer=None) -> str:
    """One conversation (user first, turns alternating) as the model would see it."""
    roles = ["user" if i % 2 == 0 else "assistant" for i in range(len(turns))]
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        messages = [{"role": role, "content": turn} for role, turn in zip(roles, turns)]
        return tokenizer.apply_chat_template(messages, tokenize=False)
    return "\n".join(f"{role.capitalize()}: {turn}" for role, turn in zip(roles, turns))
