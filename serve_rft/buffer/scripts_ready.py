"""The trainer's Lua scripts on the ready stream: delivery, acknowledgement, stale drops and
dead letters (`serve_rft.buffer.ready`). Keys and helpers as in `serve_rft.buffer.scripts`."""

from serve_rft.buffer.scripts import ALLOW_OOM, GROUP_HELPERS, PAYLOAD_HELPERS

_ACKNOWLEDGED = """
-- XACK the ready entry `id` of member `m` ('' for an entry without one); true if this call
-- acknowledged it. An entry still in the stream but in no pending entries list (the list was
-- lost: an AOF restored to an earlier point, a failover to a lagging replica) was delivered all
-- the same, and is acknowledged now too, if its member is `m`: a stream whose ids were reused
-- (a failover to a replica whose clock is behind) may hold another, never delivered, entry under
-- that id. One acknowledged before is no longer in the stream (XDEL), so a retried
-- acknowledgement counts nothing twice. A malformed id is no entry (XACK would raise midway
-- through a list, after earlier writes).
local function acknowledged(P, id, m)
  if not string.find(id, '^%d+%-%d+$') then return false end
  if redis.call('XACK', P..':ready', 'trainer', id) == 1 then return true end
  local page = redis.call('XRANGE', P..':ready', id, id)
  return #page > 0 and (entry_fields(page[1])['member'] or '') == m
end
"""

READ = ALLOW_OOM + GROUP_HELPERS + """
-- ARGV: P, consumer, count, newest (1 | 0), then the stream ids the caller holds
-- Deliver to `consumer` of the trainer group up to `count` ready entries no consumer holds, the
-- newest (1) or the oldest (0) first: XCLAIM ... FORCE puts each in the consumer's pending
-- entries list, as XREADGROUP would, whatever its position in the stream. An entry the caller
-- holds is never delivered again, even when the pending entries list lost it (an AOF restored
-- to an earlier point, a failover to a lagging replica).
-- returns {entries (as XRANGE gives them), the newest id in the stream or '0-0'}
local P, c, n, newest = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4] == '1'
local rk = P..':ready'
local also, ids = {}, {}
for j = 5, #ARGV do also[#also + 1] = ARGV[j] end
for _, e in ipairs(free_entries(rk, n, newest, also)) do ids[#ids + 1] = e[1] end
local top = redis.call('XREVRANGE', rk, '+', '-', 'COUNT', 1)
local last = top[1] and top[1][1] or '0-0'
if #ids == 0 then return {{}, last} end
ids[#ids + 1] = 'FORCE'  -- (unpack expands only as the last argument)
return {redis.call('XCLAIM', rk, 'trainer', c, 0, unpack(ids)), last}
"""

DROP_STALE = ALLOW_OOM + GROUP_HELPERS + """
-- ARGV: P, threshold, version, trained_ttl_s, limit, then the stream ids the caller holds
-- Of the `limit` oldest ready entries no trainer holds, drop those whose oldest token's policy
-- version (field v) is below `threshold` (past the trainer's staleness bound): each choice
-- marked stale-dropped with the trainer's `version`, counted. Returns how many.
local P, thr, ver, ttl, lim = ARGV[1], tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
local rk = P..':ready'
local n, also = 0, {}
for j = 6, #ARGV do also[#also + 1] = ARGV[j] end
for _, e in ipairs(free_entries(rk, lim, false, also)) do
  local f = entry_fields(e)
  local v, m = tonumber(f['v'] or ''), f['member'] or ''
  local sep = string.find(m, ':[^:]*$')
  if v and v < thr and sep then
    local st = state_key(P, string.sub(m, 1, sep - 1))
    local i = string.sub(m, sep + 1)
    redis.call('HSET', st, i, 'stale-dropped', 'v'..i, ver)
    keep_for(P, st, string.sub(m, 1, sep - 1), ttl)
    drop_entry(P, e)
    redis.call('HDEL', P..':attempts', e[1])
    n = n + 1
  end
end
if n > 0 then redis.call('HINCRBY', P..':stat', 'stale_dropped', n) end
return n
"""

ACK = ALLOW_OOM + PAYLOAD_HELPERS + _ACKNOWLEDGED + """
-- ARGV: P, trained_ttl_s, count, then per entry: stream id, member, state (trained | stale-dropped
-- | constrained: sampled under a grammar, left out of the loss | greedy: sampled (near-)greedily,
-- left out of the loss), version
-- Returns {trained, not trained}. A choice in state backlog-dropped was shed by a sweep after its
-- delivery (one that could not know the trainer held it: the pending entries list was lost), so
-- is marked and counted as `state` now, and no longer as backlog-dropped.
local P, ttl, k = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local trained, dropped, constrained, greedy, unshed = 0, 0, 0, 0, 0
for j = 0, k - 1 do
  local id, m, state, v = ARGV[4 + 4*j], ARGV[5 + 4*j], ARGV[6 + 4*j], ARGV[7 + 4*j]
  -- a member that names no choice ("{cid}:{i}") has no state to mark
  local sep = string.find(m, ':[^:]*$')
  local st = sep and state_key(P, string.sub(m, 1, sep - 1))
  local i = sep and string.sub(m, sep + 1)
  local shed = st and redis.call('HGET', st, i) == 'backlog-dropped'
  if shed or acknowledged(P, id, m) then
    if shed then unshed = unshed + 1 else remove_entry(P, id, false) end
    if st then
      redis.call('HSET', st, i, state, 'v'..i, v)
      -- readable trained_ttl_s from now (a state hash that had expired is not left without a TTL)
      keep_for(P, st, string.sub(m, 1, sep - 1), ttl)
    end
    redis.call('HDEL', P..':attempts', id)
    if state == 'trained' then trained = trained + 1
    elseif state == 'constrained' then constrained = constrained + 1
    elseif state == 'greedy' then greedy = greedy + 1
    else dropped = dropped + 1 end
  end
end
if trained > 0 then redis.call('HINCRBY', P..':stat', 'trained', trained) end
if dropped > 0 then redis.call('HINCRBY', P..':stat', 'stale_dropped', dropped) end
if constrained > 0 then redis.call('HINCRBY', P..':stat', 'constrained', constrained) end
if greedy > 0 then redis.call('HINCRBY', P..':stat', 'greedy', greedy) end
if unshed > 0 then redis.call('HINCRBY', P..':stat', 'backlog_dropped', -unshed) end
return {trained, dropped + constrained + greedy}
"""

DEAD_LETTER = ALLOW_OOM + PAYLOAD_HELPERS + _ACKNOWLEDGED + """
-- ARGV: P, maxlen, trained_ttl_s, count, then per entry: stream id, member ('' if unknown),
-- reason, exp JSON ('' if none), reward ('' if none), whole ('1': exp holds the whole experience,
-- shared fields included; '0': the entry's exp as stored, without them)
-- Moves ready entries that cannot be trained to the dead-letter stream P:dead (kept for
-- inspection and replay, capped at about maxlen entries, trimmed without a script: a letter
-- whose exp is not whole carries its own copy of the shared fields, `prompt`; a whole one has
-- `prompt` ''), acknowledging them; returns how many
local P, maxlen, ttl, k = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local n = 0
for j = 0, k - 1 do
  local id, m, why, exp, r = ARGV[5 + 6*j], ARGV[6 + 6*j], ARGV[7 + 6*j], ARGV[8 + 6*j], ARGV[9 + 6*j]
  local whole = ARGV[10 + 6*j] == '1'
  if acknowledged(P, id, m) then
    local shared = remove_entry(P, id, not whole)
    redis.call('XADD', P..':dead', 'MAXLEN', '~', maxlen, '*', 'id', id, 'member', m, 'reason', why,
               'exp', exp, 'reward', r, 'prompt', shared)
    redis.call('HDEL', P..':attempts', id)
    local sep = m ~= '' and string.find(m, ':[^:]*$')
    if sep then
      local st = state_key(P, string.sub(m, 1, sep - 1))
      redis.call('HSET', st, string.sub(m, sep + 1), 'dead-letter')
      keep_for(P, st, string.sub(m, 1, sep - 1), ttl)
    end
    n = n + 1
  end
end
if n > 0 then redis.call('HINCRBY', P..':stat', 'dead_lettered', n) end
return n
"""
