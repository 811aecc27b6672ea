"""What the experience store hands out and refuses with: its records and its domain errors.

The store raises these errors and knows nothing of HTTP; the rewards API maps each to its
status (`serve_rft.explorer.rewards_api.REFUSALS`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from serve_rft.config.service import DEFAULT_TENANT
from serve_rft.types import Experience, GroupReward, RewardedExperience


OWNER_LEN = 32
"""Length of a key's owner digest (`serve_rft.buffer.quota.key_identity`: 32 hex digits)."""


def client_group(tenant: str, group_id: str, owner: str = "") -> str:
    """The stored group id (`Experience.group_id`, ``P:grp:{gid}``) of a client's ``group_id``:
    ``k:{tenant}/{owner}/{group_id}`` for a key's group (``owner`` its `key_identity`), and with no
    key (a service without keys) ``u:{group_id}`` for `DEFAULT_TENANT`, ``t:{tenant}/{group_id}``
    for any other tenant. The prefixes keep it apart from completion ids (a completion's own
    group), from every other tenant's groups (tenant names have no ``/``) and from every other
    key's (an owner is 32 hex digits), so no key joins, sizes or shifts another key's group."""
    if owner:
        return f"k:{tenant}/{owner}/{group_id}"
    return f"u:{group_id}" if tenant == DEFAULT_TENANT else f"t:{tenant}/{group_id}"


def shown_group(gid: str, tenant: str) -> str:
    """The ``group_id`` a client of ``tenant`` named for stored group ``gid`` (`client_group`
    undone); a completion's own group (its id) as is."""
    keyed = f"k:{tenant}/"
    if gid.startswith(keyed) and gid[len(keyed) + OWNER_LEN:len(keyed) + OWNER_LEN + 1] == "/":
        return gid[len(keyed) + OWNER_LEN + 1:]
    for prefix in ("u:", f"t:{tenant}/"):
        if gid.startswith(prefix):
            return gid[len(prefix):]
    return gid


def conversation_key(tenant: str, conversation_id: str, owner: str = "") -> str:
    """The key (under the store's prefix) of a conversation's turn list: ``kconv:{tenant}/{owner}/{id}``
    for a key's conversation (``owner`` its `key_identity`: no other key adds a turn to it); with no
    key ``conv:{id}`` for `DEFAULT_TENANT`, ``tconv:{tenant}/{id}`` for any other (a key family of
    its own, so no default-tenant id can name another tenant's conversation)."""
    if owner:
        return f"kconv:{tenant}/{owner}/{conversation_id}"
    return f"conv:{conversation_id}" if tenant == DEFAULT_TENANT else f"tconv:{tenant}/{conversation_id}"


def conversation_index(tenant: str, conversation_id: str) -> str:
    """The key (under the store's prefix) of the set of turn-list keys (`conversation_key`) that
    ``tenant``'s keys made under ``conversation_id``: how a reward key, which made none of them,
    finds the conversation it rewards."""
    return f"convidx:{tenant}/{conversation_id}"


class RewardError(Exception):
    """A reward the store refuses; the subclass says why (nothing was recorded)."""


class RewardNotFinite(RewardError):
    """The reward is not a finite number (or its square, which the per-version sums add up, is
    not: about abs(r) > 1.34e154)."""


class RewardOutOfRange(RewardError):
    """The reward is outside ``buffer.reward_range``."""


class UnknownChoice(RewardError):
    """No such completion, or no such choice in it (never logged, or no longer kept)."""


class RewardConflict(RewardError):
    """The choice already has a different reward (the same one again is a duplicate, not this)."""


class RewardExpired(RewardError):
    """The choice expired (``reward_timeout_s``) before its reward came."""


class GroupSizeConflict(Exception):
    """A request's ``group_size`` differs from the size already recorded for its group."""


class ConversationFull(Exception):
    """The conversation has ``buffer.max_conversation_turns`` turns: no more may join it."""


class StoreFull(Exception):
    """Redis is past ``maxmemory`` (noeviction) and refused a write; nothing was written (retry)."""


@dataclass
class StoreCounts:
    """Experience counts. ``pending``: awaiting a reward; ``held``: rewarded, waiting for the
    rest of their group; ``ready``: in the ready stream (incl. delivered, not yet acked); the
    rest are totals since the store was created."""

    pending: int
    held: int
    ready: int
    logged: int
    rewarded: int
    trained: int
    expired: int
    stale_dropped: int
    groups_timed_out: int
    dead_lettered: int = 0
    backlog_dropped: int = 0
    constrained: int = 0
    greedy: int = 0
    redis_restarts: int = 0


@dataclass(frozen=True)
class TenantBytes:
    """What a tenant keeps in the store (`serve_rft.buffer.ledger`): ``bytes`` now, and
    ``next_free_s`` seconds until the first of it expires (None: it keeps nothing)."""

    bytes: int
    next_free_s: float | None


@dataclass
class ChoiceState:
    """One choice as `GET /v1/experiences/{completion_id}` shows it."""

    choice_index: int
    state: str
    reward: float | None
    info: dict | None
    trained_version: int | None
    token_versions: list | None


@dataclass
class DeadLetter:
    """A ready entry that cannot be trained, with why (`ExperienceStore.dead_letter`). ``whole``:
    ``exp`` holds the whole experience (its completion's shared fields included), so the letter
    needs no copy of them; otherwise ``exp`` is the entry's record as stored, and the store
    copies the shared fields into the letter."""

    stream_id: str
    member: str
    reason: str
    exp: str = ""
    reward: str = ""
    whole: bool = False

    @classmethod
    def of(cls, entry: RewardedExperience, reason: str) -> "DeadLetter":
        """A parsed ready entry with why it cannot be trained (its experience kept whole)."""
        return cls(entry.stream_id, entry.member, reason, entry.experience.model_dump_json(), repr(entry.reward),
                   whole=True)


SHARED = ("sampling", "user", "metadata")
"""Per-request fields stored once per completion (`shared_names`) when all its choices agree:
a request with ``n`` choices and large fields (a grammar, ``metadata``) is not stored ``n``
times."""


def shared_names(experiences: list[Experience]) -> set[str]:
    """The fields the choices of one completion share, stored once (the ``pr`` field of its
    record ``P:cmp:{cid}``, the first choice's values as a JSON object): the prompt token ids
    (one prompt per completion) and each of `SHARED` on which every choice agrees. Each
    choice's record leaves these fields out."""
    e0 = experiences[0]
    return {"prompt_token_ids", *(name for name in SHARED
                                  if all(getattr(e, name) == getattr(e0, name) for e in experiences[1:]))}


def experience_from(exp_json: str, shared_json: str | None) -> Experience:
    """An experience from its stored JSON and its completion's shared fields (its record's ``pr``:
    a `shared_names` object, or the bare prompt token ids list an older record has; none for
    an experience logged whole). A field the record has itself wins over the shared one.

    Raises:
        ValueError: either JSON does not parse or the result is not an `Experience`.
    """
    if not shared_json:
        return Experience.model_validate_json(exp_json)
    shared = json.loads(shared_json)
    if not isinstance(shared, dict):
        shared = {"prompt_token_ids": shared}
    return Experience.model_validate({**shared, **json.loads(exp_json)})


def parse_entries(entries: list[tuple[str, dict]]) -> tuple[list[RewardedExperience], list[DeadLetter]]:
    """Ready stream entries -> (experiences, entries that do not parse). Each entry's ``prompt``
    is its completion's shared fields (`experience_from`): its own copy, or its payload
    (``P:rp:{cid}``) the reader joined in for its ``prompt_ref``; an entry with a ``prompt_ref``
    and no ``prompt`` lost its payload and does not parse. An entry deleted while pending has no
    fields: skipped."""
    good, bad = [], []
    for entry_id, f in entries:
        if not f:
            continue
        try:
            if "prompt" not in f and f.get("prompt_ref"):
                raise ValueError(f"the shared fields of {f['prompt_ref']!r} are gone")
            group = (GroupReward(size=int(f["gn"]), mean=float(f["gmean"]), std=float(f["gstd"]))
                     if f.get("gn") else None)
            good.append(RewardedExperience(experience=experience_from(f["exp"], f.get("prompt")),
                                           reward=float(f["reward"]), stream_id=entry_id, group=group,
                                           release_version=int(f["v"]) if f.get("v") else None))
        except (KeyError, ValueError, TypeError) as e:  # pydantic's ValidationError is a ValueError
            bad.append(DeadLetter(entry_id, str(f.get("member", "")), f"unparseable: {str(e)[:200]}",
                                  str(f.get("exp", "")), str(f.get("reward", ""))))
    return good, bad

