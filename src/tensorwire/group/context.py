"""Context ids: every member of a new group derives the same one from what they all know."""

from __future__ import annotations

NEW_GROUP = 0x4E455747  # "NEWG", mixed into the contexts new_group derives
SPLIT = 0x53504C54  # "SPLT", into those split derives


def mix_context(*parts: int) -> int:
    """A context id every rank derives identically (FNV-1a over the parts), never 0 (the world)."""
    h = 2166136261
    for part in parts:
        for b in int(part).to_bytes(8, "little", signed=True):
            h = ((h ^ b) * 16777619) & 0xFFFFFFFF
    return h or 1
