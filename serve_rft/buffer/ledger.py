"""The bytes each tenant keeps in the store: every write of a tenant's completion, its experiences
and its rewards' infos is charged to the tenant with the time it will expire, and what expired is
taken off when the ledger is read (`TENANT_BYTES`). The service refuses a tenant at its
``service.quotas.per_tenant.max_stored_bytes`` (`serve_rft.explorer.http.costs`), so one tenant
cannot fill the store that every tenant logs to (Redis refuses writes past ``maxmemory``:
redis.io/docs/latest/develop/reference/eviction, ``noeviction``).

Keys (``P`` = ``buffer.key_prefix``, ``{t}`` a tenant):

==================  ======  ===============================================================
key                 type    meaning
==================  ======  ===============================================================
``P:tled:{t}``      zset    What the tenant keeps, scored by when it expires (unix s):
                            ``{cid}`` a completion's record, ``{cid}:e`` its experiences
                            (all choices: kept as long as its longest-kept choice), ``i:{h}``
                            a reward info it stored first (``P:info:{h}``).
``P:tsz:{t}``       hash    The bytes of each member of ``P:tled:{t}``.
``P:tbytes``        hash    Tenant -> the bytes its members hold now (less what expired
                            since its ledger was last read).

Each key expires a second after the last member it holds, as every key of the store has a TTL.
==================  ======  ===============================================================

The store keeps the ledger only where a limit is configured (``tenant_ledger`` of
`serve_rft.buffer.store.ExperienceStore`): it costs about 400 bytes of Redis per completion.

The bytes are the values written (JSON, token ids, reward fields) plus ``RECORD_OVERHEAD`` per
completion and ``CHOICE_OVERHEAD`` per choice for keys and fields: an estimate of what Redis
holds (its per-key overhead varies with the encoding), close enough to bound a tenant's share.
"""

from __future__ import annotations

RECORD_OVERHEAD = 160
"""Bytes charged per completion beyond its values: its record's key and fields, its group and
pending entries (an estimate)."""
CHOICE_OVERHEAD = 64
"""Bytes charged per choice beyond its experience JSON: its key, state field and pending entry."""
REWARD_OVERHEAD = 48
"""Bytes charged per rewarded choice beyond its reward's digits: its reward and info fields."""

HELPERS = """
-- The ledger of the bytes each tenant keeps (serve_rft.buffer.ledger)
local function ledger_now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

-- Charge `bytes` to `tenant` under `member` (a new member, or more bytes of one already kept),
-- kept at least until `deadline` (unix s)
-- The ledger's keys expire a second after their last member (no key without a TTL)
local function ledger_expire(keys, deadline)
  local secs = math.ceil(deadline - ledger_now()) + 1
  for _, k in ipairs(keys) do
    if redis.call('TTL', k) < secs then redis.call('EXPIRE', k, secs) end
  end
end

local function ledger_add(P, tenant, member, bytes, deadline)
  if tenant == nil or tenant == false or tenant == '' then tenant = 'default' end
  redis.call('ZADD', P..':tled:'..tenant, 'GT', deadline, member)
  redis.call('HINCRBY', P..':tsz:'..tenant, member, bytes)
  redis.call('HINCRBY', P..':tbytes', tenant, bytes)
  ledger_expire({P..':tled:'..tenant, P..':tsz:'..tenant, P..':tbytes'}, deadline)
end

-- `member` of `tenant` is kept at least until `deadline` now (nothing if it is not charged)
local function ledger_keep(P, tenant, member, deadline)
  if tenant == nil or tenant == false or tenant == '' then tenant = 'default' end
  if redis.call('ZADD', P..':tled:'..tenant, 'XX', 'GT', 'CH', deadline, member) > 0 then
    ledger_expire({P..':tled:'..tenant, P..':tsz:'..tenant, P..':tbytes'}, deadline)
  end
end

""" + f"""
local RECORD_OVERHEAD, CHOICE_OVERHEAD, REWARD_OVERHEAD = {RECORD_OVERHEAD}, {CHOICE_OVERHEAD}, {REWARD_OVERHEAD}
"""
"""Lua helpers the store's scripts share (`serve_rft.buffer.scripts.COMPLETION_HELPERS`)."""

TENANT_BYTES = """#!lua flags=allow-oom
-- ARGV: P, then tenants ('' every tenant in P:tbytes). Takes what expired off each tenant's
-- ledger, then returns per tenant {tenant, bytes, seconds until its next member expires (-1: none)}
local P = ARGV[1]
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local tenants = {}
for j = 2, #ARGV do tenants[#tenants + 1] = ARGV[j] end
if #tenants == 0 then tenants = redis.call('HKEYS', P..':tbytes') end
local out = {}
for _, tenant in ipairs(tenants) do
  local z, sz = P..':tled:'..tenant, P..':tsz:'..tenant
  while true do
    local gone = redis.call('ZRANGE', z, '-inf', now, 'BYSCORE', 'LIMIT', 0, 1000)
    if #gone == 0 then break end
    local sum = 0
    for _, b in ipairs(redis.call('HMGET', sz, unpack(gone))) do sum = sum + (tonumber(b) or 0) end
    redis.call('ZREM', z, unpack(gone))
    redis.call('HDEL', sz, unpack(gone))
    redis.call('HINCRBY', P..':tbytes', tenant, -sum)
  end
  local bytes = tonumber(redis.call('HGET', P..':tbytes', tenant) or '0')
  local next_free = -1
  local first = redis.call('ZRANGE', z, 0, 0, 'WITHSCORES')
  if #first > 0 then
    next_free = math.max(0, tonumber(first[2]) - now)
  elseif bytes ~= 0 then  -- nothing kept: nothing held (a ledger written by a partial script)
    redis.call('HDEL', P..':tbytes', tenant)
    bytes = 0
  end
  if bytes == 0 and #first == 0 then redis.call('HDEL', P..':tbytes', tenant) end
  out[#out + 1] = {tenant, bytes, tostring(next_free)}
end
return out
"""
"""Runs with ``allow-oom``: reading a full store's ledger frees its entries."""
