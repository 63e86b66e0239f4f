"""Conversation affinity: the turns of one conversation go to the replica that holds it.

Each replica's rank 0 keeps the state of the conversations it served (the prompt cache,
docs/prompt-cache.md), so a conversation's next turn is cheap only on the replica that
served its last. An OpenAI client resends the whole conversation every turn, and what stays
the same from turn to turn is its beginning: the messages up to and including the first
user message (system prompt, tools, the task), or a completion prompt's first characters.
That beginning is hashed into a key, and the key picks a replica by rendezvous hashing:
each replica scores sha256(key, replica) and the highest score wins. The same
conversation lands on the same replica while the replica set stays; a replica joining or
leaving moves only the conversations it wins or held. The chosen replica goes first only
while it has a free slot; otherwise the request goes by free slots as any other, since a
miss costs a prompt, and a wait on a full replica could cost more.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

PROMPT_PREFIX_CHARS = 2048  # a completion prompt's characters (or ids) that name it


def conversation_key(body: dict[str, Any]) -> str | None:
    """The key of the conversation a request continues; None when it names none."""
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        first_user = next((i for i, m in enumerate(messages)
                           if isinstance(m, dict) and m.get("role") == "user"), None)
        opening = messages if first_user is None else messages[:first_user + 1]
        return _digest(opening)
    prompt = body.get("prompt")
    if isinstance(prompt, (str, list)) and prompt:
        return _digest(prompt[:PROMPT_PREFIX_CHARS])
    return None


def _digest(value: Any) -> str | None:
    try:
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError):  # not JSON-shaped: the engine will refuse it by name
        return None
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def preferred(replicas: list[str], key: str) -> str:
    """The replica that a conversation's key picks among `replicas` (rendezvous hashing)."""
    return max(replicas, key=lambda r: hashlib.sha256(f"{key}\0{r}".encode()).digest())
