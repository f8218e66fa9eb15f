"""Context ids: every member of a new group derives the same one from what they all know."""

from __future__ import annotations

NEW_GROUP = 0x4E455747  # "NEWG", mixed into the contexts new_group derives
SPLIT = 0x53504C54  # "SPLT", into those split derives


def context_of(data: bytes) -> int:
    """A context id every rank derives identically from `data` (32-bit FNV-1a), never 0 (the
    world's)."""
    h = 2166136261
    for b in data:
        h = ((h ^ b) * 16777619) & 0xFFFFFFFF
    return h or 1


def mix_context(*parts: int) -> int:
    """context_of the parts, 8 bytes each."""
    return context_of(b"".join(int(part).to_bytes(8, "little", signed=True) for part in parts))
