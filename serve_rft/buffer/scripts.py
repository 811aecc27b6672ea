"""The store's Redis Lua scripts: every state change of an experience is one of these, atomic.

Keys are built inside the scripts from the prefix (``ARGV[1]``), so the store needs a single
Redis node (not Redis Cluster). Schema: `serve_rft.buffer.store`. The trainer's scripts on the
ready stream are in `serve_rft.buffer.scripts_ready`.
"""

from serve_rft.buffer import ledger

# Shared Lua helpers of a completion's record: its choices' states and its shared fields are
# fields of ``P:cmp:{cid}`` (one key per completion). A record an earlier schema wrote keeps them
# in keys of their own (``P:st:{cid}``, ``P:pr:{cid}``), still read and written there, so a store
# written before an upgrade is served, rewarded and trained as it was.
COMPLETION_HELPERS = ledger.HELPERS + """
-- The hash of a completion's choice states, rewards, infos and versions: its record, or the
-- P:st key an earlier schema kept them in
local function state_key(P, cid)
  local old = P..':st:'..cid
  if redis.call('EXISTS', old) == 1 then return old end
  return P..':cmp:'..cid
end

-- A completion's shared fields (JSON), or false if it has none
local function shared_of(P, cid)
  return redis.call('HGET', P..':cmp:'..cid, 'pr') or redis.call('GET', P..':pr:'..cid)
end

-- Keep completion cid's record (st: its `state_key`) at least ttl s from now, and the reward infos
-- it names (info{j} = '@'..h: the JSON once in P:info:{h}) at least as long as the record
-- (and the tenant's ledger with them: serve_rft.buffer.ledger)
local function keep_for(P, st, cid, ttl)
  if redis.call('TTL', st) < ttl then redis.call('EXPIRE', st, ttl) end
  local left = redis.call('TTL', st)
  local tenant = redis.call('HGET', P..':cmp:'..cid, 'tenant')
  local until_s = ledger_now() + left
  ledger_keep(P, tenant, cid, until_s)
  local n = tonumber(redis.call('HGET', P..':cmp:'..cid, 'n') or '') or 0
  if n == 0 then return end
  local fields = {}
  for j = 0, n - 1 do fields[#fields + 1] = 'info'..j end
  for _, ref in ipairs(redis.call('HMGET', st, unpack(fields))) do
    if ref and string.sub(ref, 1, 1) == '@' then
      local k = P..':info:'..string.sub(ref, 2)
      if redis.call('TTL', k) < left then redis.call('EXPIRE', k, left) end
      ledger_keep(P, tenant, 'i:'..string.sub(ref, 2), until_s)
    end
  end
end
"""

# Shared Lua helpers of the ready entries' payload: a completion's shared fields (its record's ``pr``)
# are held once for all of its ready entries in ``P:rp:{cid}`` (``payload``; ``refs`` = how many
# entries name it in their ``prompt_ref`` field), deleted with the last of them. It has no TTL:
# every removal of a ready entry goes through `drop_entry` or `remove_entry`, which release the
# reference exactly when XDEL removed the entry (XDEL returns how many it removed).
PAYLOAD_HELPERS = COMPLETION_HELPERS + """
-- A stream entry's fields ({id, {k1, v1, ...}}) as a table
local function entry_fields(e)
  local f = {}
  for j = 1, #e[2], 2 do f[e[2][j]] = e[2][j + 1] end
  return f
end

-- XDEL the ready entry e ({id, fields}); if this call removed it, one reference fewer to its
-- payload (deleted with its last reference)
local function drop_entry(P, e)
  if redis.call('XDEL', P..':ready', e[1]) == 0 then return end
  local cid = entry_fields(e)['prompt_ref']
  if not cid then return end  -- an entry that carries its own copy (`prompt`), or none
  local rp = P..':rp:'..cid
  if redis.call('HINCRBY', rp, 'refs', -1) <= 0 then redis.call('DEL', rp) end
end

-- Remove the ready entry `id` if it is still in the stream (`drop_entry`). With `want_shared`,
-- returns its completion's shared fields (its own copy or its payload's, '' if none); else ''
-- (its payload is not read)
local function remove_entry(P, id, want_shared)
  local page = redis.call('XRANGE', P..':ready', id, id)
  if #page == 0 then return '' end
  local shared
  if want_shared then
    local f = entry_fields(page[1])
    shared = f['prompt']
    if not shared and f['prompt_ref'] then
      shared = redis.call('HGET', P..':rp:'..f['prompt_ref'], 'payload')
    end
  end
  drop_entry(P, page[1])
  return shared or ''
end
"""

# Shared Lua helpers: release a group (its held, rewarded members go to the ready stream).
GROUP_HELPERS = PAYLOAD_HELPERS + """
local function release(P, gid)
  local g = P..':grp:'..gid
  local gm = P..':gm:'..gid
  local members = redis.call('SMEMBERS', gm)
  local out = {}
  for _, m in ipairs(members) do
    local sep = string.find(m, ':[^:]*$')
    local cid, i = string.sub(m, 1, sep - 1), string.sub(m, sep + 1)
    local exp = redis.call('GET', P..':exp:'..cid..':'..i)
    local st = state_key(P, cid)
    local reward = redis.call('HGET', st, 'r'..i)
    if exp and reward then
      -- v: the policy version of its oldest token (what staleness is counted from)
      local v = 0
      local ok, e = pcall(cjson.decode, exp)
      if ok and type(e) == 'table' and type(e['token_versions']) == 'table' then
        for k, span in ipairs(e['token_versions']) do
          if type(span) == 'table' and type(span[1]) == 'number' and (k == 1 or span[1] < v) then
            v = span[1]
          end
        end
      end
      out[#out + 1] = {m = m, cid = cid, i = i, st = st, exp = exp, reward = reward, v = v}
    end
  end
  -- The group's reward statistics are fixed at its first release, over the members released
  -- then, and carried by every ready entry of the group (members released late carry the same):
  -- a member's advantage never depends on how the trainer batches. The entries of one release
  -- carry the group's oldest version as v, so a staleness bound drops them together.
  local gn, gmean, gstd = redis.call('HGET', g, 'gn'), redis.call('HGET', g, 'gmean'), redis.call('HGET', g, 'gstd')
  if not gn and #out > 0 then
    local k, sum, sq = #out, 0, 0
    for _, x in ipairs(out) do sum = sum + tonumber(x.reward) end
    local mean = sum / k
    for _, x in ipairs(out) do sq = sq + (tonumber(x.reward) - mean) ^ 2 end
    local std = k >= 2 and math.sqrt(sq / (k - 1)) or 0
    -- a sum past the float range (rewards are each finite, squares too): no statistics, as singletons
    if mean ~= mean or std ~= std or mean == math.huge or mean == -math.huge or std == math.huge then
      k, mean, std = 1, 0, 0
    end
    gn, gmean, gstd = tostring(k), string.format('%.17g', mean), string.format('%.17g', std)
    redis.call('HSET', g, 'gn', gn, 'gmean', gmean, 'gstd', gstd)
  end
  local vmin
  for _, x in ipairs(out) do if not vmin or x.v < vmin then vmin = x.v end end
  for _, x in ipairs(out) do
    local pr = shared_of(P, x.cid)
    if pr then  -- the shared fields once per completion, whatever its ready entries
      local rp = P..':rp:'..x.cid
      redis.call('HSETNX', rp, 'payload', pr)
      redis.call('HINCRBY', rp, 'refs', 1)
      redis.call('XADD', P..':ready', '*', 'exp', x.exp, 'reward', x.reward, 'member', x.m,
                 'prompt_ref', x.cid, 'v', vmin, 'g', gid, 'gn', gn, 'gmean', gmean, 'gstd', gstd)
    else  -- an experience logged whole (no shared fields)
      redis.call('XADD', P..':ready', '*', 'exp', x.exp, 'reward', x.reward, 'member', x.m, 'prompt', '',
                 'v', vmin, 'g', gid, 'gn', gn, 'gmean', gmean, 'gstd', gstd)
    end
    redis.call('HSET', x.st, x.i, 'ready')
  end
  local n = #out
  redis.call('DEL', gm)
  redis.call('HSET', g, 'released', '1')
  redis.call('ZREM', P..':gdl', gid)
  if n > 0 then redis.call('HINCRBY', P..':stat', 'ready', n) end
  return n
end

-- Ready entries no consumer of the trainer group holds (not in its pending entries list, which
-- is small: what a trainer holds, nor in `also`, the ids a trainer says it holds), up to `n`,
-- newest first (`newest`) or oldest first
local function free_entries(rk, n, newest, also)
  local held, h = {}, 0
  if redis.call('EXISTS', rk) == 0 then return {} end
  local ok, pend = pcall(redis.call, 'XPENDING', rk, 'trainer', '-', '+', 1000000)
  if ok then
    for _, p in ipairs(pend) do held[p[1]] = true end
    h = #pend
  end
  for _, id in ipairs(also or {}) do
    if not held[id] then held[id] = true; h = h + 1 end
  end
  local page
  if newest then page = redis.call('XREVRANGE', rk, '+', '-', 'COUNT', n + h)
  else page = redis.call('XRANGE', rk, '-', '+', 'COUNT', n + h) end
  local out = {}
  for _, e in ipairs(page) do
    if #out >= n then break end
    if not held[e[1]] then out[#out + 1] = e end
  end
  return out
end

local function complete(P, gid)
  local g = P..':grp:'..gid
  local size = tonumber(redis.call('HGET', g, 'size') or '0')
  local rewarded = tonumber(redis.call('HGET', g, 'rewarded') or '0')
  local expired = tonumber(redis.call('HGET', g, 'expired') or '0')
  return size > 0 and rewarded > 0 and rewarded + expired >= size
end
"""

LOG = ledger.HELPERS + """
-- ARGV: P, ttl_pending, ttl_long, max_turns, then the completions' heads: one MessagePack array
-- (Redis's bundled cmsgpack) of {cid, n, gid, group_size, now, deadline, conv (the key of its
-- turn list under P, '' for none), version, tenant, conversation index (the key under P of the set
-- of its tenant's turn lists of that id, '' for none; absent from older callers), '1' to charge it to
-- its tenant's ledger (absent or '': not)}, every field a
-- string; then, from ARGV[6],
-- each completion's JSON in the heads' order: its shared fields (the prompt's token ids once per
-- completion) and its n choices without them. The JSON stays in ARGV: Lua copies it once, not
-- again out of the MessagePack.
-- returns per completion, in order: n (logged), 0 (logged before), or an error message (nothing
-- of it written: every check is a read before its first write, the first write being the
-- group's, which raises WRONGTYPE for a key of another type). Each completion runs in pcall,
-- so one refused completion leaves the others logged; past maxmemory, Redis refuses a script's
-- first write only, so every completion of the call is refused alike (error "OOM ...").
local P, ttl_p, ttl_l, max_turns = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local pending = {}  -- score, member, ... of the completions logged: one ZADD per call
-- `cmd key args...` in calls of at most 2000 args (unpack takes a bounded number of values)
local function call_chunked(cmd, key, args)
  for k = 1, #args, 2000 do redis.call(cmd, key, unpack(args, k, math.min(k + 1999, #args))) end
end
local function log_one(c, a)
  -- a: the ARGV index of its shared fields; its choices' JSON follow
  local cid, n, gid, conv = c[1], tonumber(c[2]), c[3], c[7]
  local cmp = P..':cmp:'..cid
  -- a completion is logged once: a call re-sent after a lost reply (client retry) changes nothing
  if redis.call('EXISTS', cmp) == 1 then return 0 end
  -- bounded: a turn that raced past the request check of a full conversation is logged (its
  -- choices can be rewarded one by one) but does not join the list a conversation reward reads
  local ck = conv ~= '' and P..':'..conv
  local turns = ck and redis.call('LLEN', ck)
  -- the group's first: a key of another type raises WRONGTYPE here, before any write; past
  -- maxmemory Redis refuses this first write, nothing written
  local g = P..':grp:'..gid
  redis.call('HSETNX', g, 'size', c[4])
  redis.call('HINCRBY', g, 'logged', n)
  redis.call('EXPIRE', g, ttl_l)
  -- the record: the shared fields and every choice's state
  local record = {'n', n, 'group', gid, 'conv', conv, 'created', c[5], 'ver', c[8], 'tenant', c[9], 'pr', ARGV[a]}
  for i = 0, n - 1 do
    record[#record + 1] = tostring(i)
    record[#record + 1] = 'pending'
  end
  call_chunked('HSET', cmp, record)
  redis.call('EXPIRE', cmp, ttl_l)
  for i = 0, n - 1 do
    redis.call('SET', P..':exp:'..cid..':'..i, ARGV[a + 1 + i], 'EX', ttl_p)
  end
  if ck then
    if turns < max_turns then redis.call('RPUSH', ck, cid) end
    redis.call('EXPIRE', ck, ttl_l)
    if c[10] and c[10] ~= '' then
      redis.call('SADD', P..':'..c[10], conv)
      redis.call('EXPIRE', P..':'..c[10], ttl_l)
    end
  end
  for i = 0, n - 1 do
    pending[#pending + 1] = c[6]
    pending[#pending + 1] = cid..':'..i
  end
  -- the tenant's ledger: the record as long as it is kept, the experiences while pending
  if c[11] == '1' then
    local now, exp_bytes = ledger_now(), 0
    for i = 0, n - 1 do exp_bytes = exp_bytes + #ARGV[a + 1 + i] + CHOICE_OVERHEAD end
    ledger_add(P, c[9], cid, #ARGV[a] + #gid + #conv + RECORD_OVERHEAD, now + ttl_l)
    ledger_add(P, c[9], cid..':e', exp_bytes, now + ttl_p)
  end
  return n
end
local out, logged, a = {}, 0, 6
for j, c in ipairs(cmsgpack.unpack(ARGV[5])) do
  local ok, r = pcall(log_one, c, a)
  a = a + 1 + tonumber(c[2])
  if ok then
    out[j] = r
    logged = logged + r
  else  -- redis.call raises a table {err = message}
    out[j] = type(r) == 'table' and tostring(r.err) or tostring(r)
  end
end
call_chunked('ZADD', P..':pending', pending)
if logged > 0 then redis.call('HINCRBY', P..':stat', 'logged', logged) end
return out
"""

# Scripts that free memory (or move it) run even when Redis is past maxmemory (noeviction):
# the trainer's acknowledgements and the sweep's expiries are how a full store drains.
ALLOW_OOM = "#!lua flags=allow-oom\n"

REWARD = GROUP_HELPERS + """
-- ARGV: P, cid, i, reward, info, now, group_timeout_s, ttl_rewarded, tenant ('' any: an admin),
-- info_ref, '1' to charge what it stores to the completion's tenant's ledger (absent or '': not)
-- info: the reward's info JSON ('' none), stored once as P:info:{info_ref} (info_ref: a digest of
-- it) however many choices a request rewards with it; the choice's info{i} names it ('@'..info_ref)
-- A completion of another tenant than `tenant` answers 404, as one never logged (a record
-- without a tenant was logged for the default tenant)
-- ttl_rewarded = reward_timeout_s + trained_ttl_s: a held member outlives the longest hold of its
-- group (released at the latest reward_timeout_s after the first reward) by trained_ttl_s
-- returns {status, previous reward or ''}; 201 recorded, 200 same reward again, 404, 409, 410,
-- 422 (the reward, its square or a sum it enters is not a finite number: nothing written)
-- Everything that can fail is checked before the first write: a script that raises an error
-- midway keeps the writes it made (a script runs atomically but is never rolled back; Redis docs,
-- "Scripting with Lua" and "Transactions", errors inside a transaction), so no input may make
-- one fail after writing (HINCRBYFLOAT refuses a result that is not finite).
local P, cid, i = ARGV[1], ARGV[2], ARGV[3]
local function finite(x) return x ~= nil and x == x and x ~= math.huge and x ~= -math.huge end
local cmp = P..':cmp:'..cid
local n = redis.call('HGET', cmp, 'n')
if not n then return {404, ''} end
local caller = ARGV[9] or ''
if caller ~= '' and (redis.call('HGET', cmp, 'tenant') or 'default') ~= caller then return {404, ''} end
if tonumber(i) >= tonumber(n) then return {404, ''} end
local gid = redis.call('HGET', cmp, 'group')
if not gid then return {404, ''} end
local st = state_key(P, cid)
local prev = redis.call('HGET', st, 'r'..i)
if prev then
  if prev == ARGV[4] then return {200, prev} end
  return {409, prev}
end
local ek = P..':exp:'..cid..':'..i
if redis.call('EXISTS', ek) == 0 then return {410, ''} end
local r = tonumber(ARGV[4])
if not finite(r) or not finite(r * r) then return {422, ''} end
-- per policy version and generation time (REWARD_BUCKET_S buckets): what canary verdicts compare
local ver = redis.call('HGET', cmp, 'ver')
local created = tonumber(redis.call('HGET', cmp, 'created') or '')
local vk, b
if ver and created then
  b = tostring(math.floor(created / 5))
  vk = P..':vr:'..ver..':'..tostring(math.floor(created / 3600))
  local s = tonumber(redis.call('HGET', vk, b..':s') or '0')
  local q = tonumber(redis.call('HGET', vk, b..':q') or '0')
  if not finite(s) or not finite(q) or not finite(s + r) or not finite(q + r * r) then return {422, ''} end
end
local ttl = tonumber(ARGV[8])
redis.call('HSET', st, 'r'..i, ARGV[4], i, 'rewarded')
local owner, now_s, charged = redis.call('HGET', cmp, 'tenant'), ledger_now(), ARGV[11] == '1'
if ARGV[5] ~= '' then
  local ik = P..':info:'..ARGV[10]
  if redis.call('EXISTS', ik) == 0 then
    redis.call('SET', ik, ARGV[5], 'EX', ttl)
    if charged then ledger_add(P, owner, 'i:'..ARGV[10], #ARGV[5] + #ik, now_s + ttl) end
  end
  redis.call('HSET', st, 'info'..i, '@'..ARGV[10])
end
-- the tenant's ledger: the reward's fields with the record, the experiences kept from now
if charged then
  ledger_add(P, owner, cid, #ARGV[4] + REWARD_OVERHEAD, now_s + ttl)
  ledger_keep(P, owner, cid..':e', now_s + ttl)
end
-- the record (with the shared fields) is kept as long as its longest-kept choice, its infos as long
keep_for(P, st, cid, ttl)
redis.call('EXPIRE', ek, ttl)
if st ~= cmp then  -- an earlier schema's keys: the record and the shared fields apart
  for _, k in ipairs({cmp, P..':pr:'..cid}) do
    if redis.call('TTL', k) < ttl then redis.call('EXPIRE', k, ttl) end
  end
end
redis.call('ZREM', P..':pending', cid..':'..i)
redis.call('HINCRBY', P..':stat', 'rewarded', 1)
if vk then
  redis.call('HINCRBY', vk, b..':n', 1)
  redis.call('HINCRBYFLOAT', vk, b..':s', ARGV[4])
  redis.call('HINCRBYFLOAT', vk, b..':q', string.format('%.17g', r * r))
  redis.call('EXPIRE', vk, ttl)
end
local g = P..':grp:'..gid
redis.call('SADD', P..':gm:'..gid, cid..':'..i)
redis.call('EXPIRE', P..':gm:'..gid, ttl)
local rewarded = redis.call('HINCRBY', g, 'rewarded', 1)
redis.call('EXPIRE', g, ttl)
if rewarded == 1 then
  redis.call('HSET', g, 'first', ARGV[6])
  redis.call('ZADD', P..':gdl', tonumber(ARGV[6]) + tonumber(ARGV[7]), gid)
end
local first = tonumber(redis.call('HGET', g, 'first') or ARGV[6])
local due = first + tonumber(ARGV[7])
if redis.call('HGET', g, 'released') == '1' or complete(P, gid)
   or (rewarded >= 2 and tonumber(ARGV[6]) >= due) then
  release(P, gid)
elseif rewarded == 2 then
  redis.call('ZADD', P..':gdl', due, gid)  -- a sweep may have pushed it to the final deadline
end
return {201, ARGV[4]}
"""

SWEEP = ALLOW_OOM + GROUP_HELPERS + """
-- ARGV: P, now, reward_timeout_s, limit, max_ready, then the stream ids the caller holds (a
-- trainer's; none from any other caller) ; expire pending experiences, release timed-out
-- groups, drop the oldest undelivered ready entries past max_ready (0: no bound), at most `limit`
-- of each per call (one call never blocks Redis for long; the caller loops)
-- returns {expired, groups released by timeout, ready entries dropped}
local P, now, rto, lim = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local max_ready = tonumber(ARGV[5])
local also = {}
for j = 6, #ARGV do also[#also + 1] = ARGV[j] end
local gone = redis.call('ZRANGEBYSCORE', P..':pending', '-inf', now, 'LIMIT', 0, lim)
for _, m in ipairs(gone) do
  redis.call('ZREM', P..':pending', m)
  local sep = string.find(m, ':[^:]*$')
  local cid, i = string.sub(m, 1, sep - 1), string.sub(m, sep + 1)
  -- a late sweep (the service was down past the keys' TTLs) finds some of them expired: only
  -- what still exists is updated, so nothing is re-created without a TTL
  local st = state_key(P, cid)
  if redis.call('EXISTS', st) == 1 then redis.call('HSET', st, i, 'expired') end
  redis.call('DEL', P..':exp:'..cid..':'..i)
  local gid = redis.call('HGET', P..':cmp:'..cid, 'group')
  if gid and redis.call('EXISTS', P..':grp:'..gid) == 1 then
    redis.call('HINCRBY', P..':grp:'..gid, 'expired', 1)
    if redis.call('HGET', P..':grp:'..gid, 'released') ~= '1' and complete(P, gid) then release(P, gid) end
  end
end
if #gone > 0 then redis.call('HINCRBY', P..':stat', 'expired', #gone) end
local timed_out = 0
for _, gid in ipairs(redis.call('ZRANGEBYSCORE', P..':gdl', '-inf', now, 'LIMIT', 0, lim)) do
  local g = P..':grp:'..gid
  local rewarded = tonumber(redis.call('HGET', g, 'rewarded') or '0')
  local first = tonumber(redis.call('HGET', g, 'first') or ARGV[2])
  if redis.call('EXISTS', g) == 0 then
    redis.call('ZREM', P..':gdl', gid)  -- expired with its members: nothing left to release
    redis.call('DEL', P..':gm:'..gid)
  elseif rewarded >= 2 or now - first >= rto then
    release(P, gid)
    timed_out = timed_out + 1
  else
    redis.call('ZADD', P..':gdl', first + rto, gid)
  end
end
if timed_out > 0 then redis.call('HINCRBY', P..':stat', 'groups_timed_out', timed_out) end
-- the ready stream past max_ready: nothing consumes it fast enough (serve-only mode, a trainer
-- slower than the traffic); the oldest entries no trainer holds are dropped,
-- each choice marked and counted (entries in the pending entries list or in `also` are never
-- touched; a sweep by a replica cannot know what a trainer holds once that list was lost: ACK
-- counts a choice shed after its delivery as the trainer says, and no longer as dropped)
local shed = 0
local rk = P..':ready'
local excess = max_ready > 0 and redis.call('XLEN', rk) - max_ready or 0
if excess > 0 then
  -- whole groups: past `excess`, the entries right after the last one dropped that belong to
  -- its group (a release's entries are consecutive) go too, within this call's `limit`
  local last
  for _, e in ipairs(free_entries(rk, lim, false, also)) do
    local f = entry_fields(e)
    if shed >= excess and (not last or f['g'] ~= last) then break end
    last = f['g']
    local m = f['member'] or ''
    local sep = string.find(m, ':[^:]*$')
    local st = sep and state_key(P, string.sub(m, 1, sep - 1))
    if st and redis.call('EXISTS', st) == 1 then redis.call('HSET', st, string.sub(m, sep + 1), 'backlog-dropped') end
    drop_entry(P, e)
    shed = shed + 1
  end
  if shed > 0 then redis.call('HINCRBY', P..':stat', 'backlog_dropped', shed) end
end
return {#gone, timed_out, shed}
"""
