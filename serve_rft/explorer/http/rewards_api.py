"""The rewards and experiences HTTP API, over the `ExperienceStore` (no FastAPI here: the
replica routes to these and turns `ApiError` into the OpenAI error JSON).

Rewards are recorded one choice at a time by the store's reward script (atomic, idempotent:
the same reward again is accepted as ``duplicate``). The items of a request are independent:
each gets its own result (``recorded``, ``duplicate`` or ``refused`` with its OpenAI-style
``error``), a refused item (unknown, expired, conflicting, outside its group) never keeps the
others from being recorded, and posting the same request again records whatever is left (the
recorded ones answer ``duplicate``). The request as a whole answers 507 (+ Retry-After) when an
item was refused because the store is full (retrying the request is safe and needed), else 200
when at least one item was recorded or already was; when every item is refused it answers the
first refusal's status (404 / 409 / 410 / 422) with the per-item results alongside the error. A malformed request
(bad form, unknown completion of a ``rewards`` list, a list that does not match the choices,
or a reward of a ``rewards`` list or a conversation that the store would refuse: not a finite
number, or outside ``buffer.reward_range``) is refused whole, before anything is recorded; in a
batch or a group each item's reward is checked with its own result. Nothing accepted is dropped.

Tenants (`serve_rft.explorer.http.auth.Identity`): a caller reaches only its own tenant's completions
(an admin reaches all). Another tenant's completion is answered exactly as one that does not
exist (404, ``not_found``, same message), checked before anything is written. Groups and
conversations belong to the key that sent them (`serve_rft.buffer.records.client_group`); a
``group_id`` names the group as the completion's own client named it, a ``conversation_id`` the
tenant's conversation of that id (`_conversation`: the caller's own first, else the one key's
that has it; when several keys have one, the request names it by a turn's ``completion_id``).
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

from serve_rft.buffer.records import (RewardConflict, RewardError, RewardExpired, RewardNotFinite,
                                      RewardOutOfRange, StoreFull, UnknownChoice, conversation_key,
                                      shown_group)
from serve_rft.buffer.store import ExperienceStore
from serve_rft.explorer.http.auth import OPEN, Identity
from serve_rft.explorer.http.protocol import (ApiError, ChoiceRewards, ConversationReward, GroupRewards,
                                         RewardBatch, RewardItem, RewardRequest)

REFUSALS: dict[type[Exception], tuple[int, str, str | None]] = {
    # the store's refusal -> (HTTP status, OpenAI error code, param)
    RewardNotFinite: (422, "invalid_reward", "reward"),
    RewardOutOfRange: (422, "reward_out_of_range", "reward"),
    UnknownChoice: (404, "not_found", "completion_id"),
    RewardConflict: (409, "conflict", "completion_id"),
    RewardExpired: (410, "expired", "completion_id"),
    StoreFull: (507, "store_full", None),
}


def _unknown(completion_id: str) -> ApiError:
    """The 404 of a completion that does not exist, or that the caller's tenant does not own."""
    return ApiError(404, f"no completion {completion_id!r}", "completion_id", code="not_found")


async def _reached(store: ExperienceStore, completion_id: str, who: Identity) -> tuple[int, str, str | None]:
    """``completion_id``'s (choices, tenant, stored group key) if ``who`` reaches it
    (`ExperienceStore.completion_meta`).

    Raises:
        ApiError: 404 unknown, or another tenant's (`_unknown`).
    """
    meta = await store.completion_meta(completion_id)
    if meta is None or not who.reaches(meta[1]):
        raise _unknown(completion_id)
    return meta


async def _items(store: ExperienceStore, req: RewardRequest, who: Identity) -> list[RewardItem]:
    """Expand any reward form into single-choice items.

    Raises:
        ApiError: 404 unknown (or another tenant's) completion / conversation, 422 a reward list that does not
            match the completion's choices, or a reward of a list or conversation the store
            would refuse (`_whole`).
    """
    if isinstance(req, RewardItem):
        return [req]
    if isinstance(req, RewardBatch):
        return list(req.rewards)
    if isinstance(req, ChoiceRewards):
        n, _, _ = await _reached(store, req.completion_id, who)
        if len(req.rewards) != n:
            raise ApiError(422, f"completion {req.completion_id!r} has {n} choices, got {len(req.rewards)} "
                           "rewards", "rewards", code="invalid_reward")
        return _whole(store, [RewardItem(completion_id=req.completion_id, choice_index=i, reward=r,
                                         info=req.info) for i, r in enumerate(req.rewards)])
    if isinstance(req, GroupRewards):
        return list(req.rewards)  # each member's group is checked with its own result
    assert isinstance(req, ConversationReward)
    turns = await store.turns_of(await _conversation(store, req, who))
    if not turns:
        raise ApiError(404, f"no conversation {req.conversation_id!r}", "conversation_id", code="not_found")
    items = []
    for t, cid in enumerate(turns):
        n = await store.num_choices(cid) or 0
        r = req.reward * req.discount ** (len(turns) - 1 - t)
        items += [RewardItem(completion_id=cid, choice_index=i, reward=r, info=req.info) for i in range(n)]
    return _whole(store, items)


async def _conversation(store: ExperienceStore, req: ConversationReward, who: Identity) -> str:
    """The stored conversation (`serve_rft.buffer.records.conversation_key`) ``req`` rewards:
    the tenant's of that id that ``req.completion_id`` is a turn of; without one, the caller's own
    of that id if it has one (an admin key's), else the only one of the tenant's keys' of that id.

    Raises:
        ApiError: 404 no such conversation (or ``completion_id`` no turn of one of that id);
            409 ``ambiguous_conversation`` (param ``completion_id``): several keys of the tenant
            have a conversation of that id and the request names none of them.
    """
    own = conversation_key(who.tenant, req.conversation_id, who.owner)
    found = await store.conversations(req.conversation_id, who.tenant)
    if req.completion_id is not None:
        of = await store.conversation_of(req.completion_id)
        if of is None or (of not in found and of != own):
            raise ApiError(404, f"completion {req.completion_id!r} is no turn of conversation "
                           f"{req.conversation_id!r}", "completion_id", code="not_found")
        return of
    if who.owner and await store.turns_of(own):
        return own
    if len(found) > 1:
        raise ApiError(409, f"{len(found)} keys have a conversation {req.conversation_id!r}: name it by "
                       "one of its turns' completion_id", "completion_id", code="ambiguous_conversation")
    if not found:
        raise ApiError(404, f"no conversation {req.conversation_id!r}", "conversation_id", code="not_found")
    return found[0]


def _whole(store: ExperienceStore, items: list[RewardItem]) -> list[RewardItem]:
    """``items`` if the store accepts every reward of them (`ExperienceStore.check_reward`).

    Raises:
        ApiError: 422 (param ``reward``) naming the first refused reward: the request is
            refused whole, nothing recorded.
    """
    for item in items:
        try:
            store.check_reward(item.reward)
        except RewardError as e:
            status, code, param = REFUSALS[type(e)]
            raise ApiError(status, f"choice {item.choice_index} of {item.completion_id!r}: {e}; nothing "
                           "was recorded", param, code=code) from None
    return items


def _refused(item: RewardItem, e: ApiError) -> dict[str, Any]:
    reward = item.reward if math.isfinite(item.reward) else None  # JSON has no NaN / Infinity
    return {"completion_id": item.completion_id, "choice_index": item.choice_index, "reward": reward,
            "status": "refused", "status_code": e.status, **e.body()}


async def _post_one(store: ExperienceStore, req: RewardRequest, item: RewardItem, who: Identity) -> dict[str, Any]:
    """Record one item; a refusal becomes its result.

    Raises:
        ApiError: never for a refusal of the item itself (that is its result).
    """
    try:
        if isinstance(req, GroupRewards):
            meta = await store.completion_meta(item.completion_id)
            if meta is None or meta[2] is None or not who.reaches(meta[1]):
                raise UnknownChoice(f"no completion {item.completion_id!r}")
            _, owner, group = meta
            if shown_group(group, owner) != req.group_id:
                return _refused(item, ApiError(422, f"completion {item.completion_id!r} is not in group "
                                               f"{req.group_id!r}", "group_id", code="not_in_group"))
        recorded = await store.post_reward(item.completion_id, item.choice_index, item.reward, item.info,
                                           tenant=who.owner_filter)
    except (RewardError, StoreFull) as e:
        status, code, param = REFUSALS[type(e)]
        return _refused(item, ApiError(status, str(e), param, code=code))
    return {"completion_id": item.completion_id, "choice_index": item.choice_index,
            "reward": item.reward, "status": "recorded" if recorded else "duplicate"}


async def post_rewards(store: ExperienceStore, req: RewardRequest, who: Identity = OPEN) -> list[dict[str, Any]]:
    """Record every reward of ``req`` for caller ``who``, each independently (module docstring).

    Returns:
        One result per choice: ``{"completion_id", "choice_index", "reward", "status"}`` with
        status ``recorded`` | ``duplicate`` | ``refused``; a refused one also has
        ``status_code`` (its HTTP status) and ``error`` (OpenAI error object).
    Raises:
        ApiError: a malformed request (404 unknown, or another tenant's, completion of a
            ``rewards`` list, or unknown conversation; 422 a list that does not match the
            choices): nothing recorded.
    """
    return [await _post_one(store, req, item, who) for item in await _items(store, req, who)]


def _deciding(results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The item whose refusal decides the request's status (`batch_status`), or None for 200."""
    refused = [r for r in results if r["status"] == "refused"]
    retry = [r for r in refused if int(r["status_code"]) >= 500]
    if retry:
        return retry[0]
    if not refused or len(refused) < len(results):
        return None
    return refused[0]


def batch_status(results: list[dict[str, Any]]) -> int:
    """HTTP status of a reward request: a retryable refusal of any item (507 store full) makes
    the whole answer that status, so a client that looks only at the status retries (the items
    recorded answer ``duplicate`` then); otherwise 200 if any item was recorded (or already
    was), else the first refusal's status."""
    deciding = _deciding(results)
    return 200 if deciding is None else int(deciding["status_code"])


def batch_body(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The answer's JSON: every item's result (``data``), and when `batch_status` is a refusal,
    the ``error`` of the item that decided it (OpenAI error JSON beside the results)."""
    deciding = _deciding(results)
    body: dict[str, Any] = {"object": "list", "data": results}
    return body if deciding is None else {"error": deciding["error"], **body}


async def describe_completion(store: ExperienceStore, completion_id: str, who: Identity = OPEN) -> dict[str, Any]:
    """``GET /v1/experiences/{completion_id}`` for caller ``who``: the completion's tenant, its
    group (as its client named it) and each choice's state (pending / rewarded (held for its
    group) / ready / trained / expired / stale-dropped / constrained), reward, info, the version
    that trained it, and the policy versions that produced its tokens.

    Raises:
        ApiError: 404 unknown (or no longer kept, or another tenant's) completion.
    """
    _, owner, group = await _reached(store, completion_id, who)
    choices = await store.choices(completion_id)
    if choices is None:
        raise _unknown(completion_id)
    return {"object": "experience", "completion_id": completion_id, "tenant": owner,
            "group_id": shown_group(group, owner) if group else group,
            "choices": [asdict(c) for c in choices]}
