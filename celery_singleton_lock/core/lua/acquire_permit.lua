-- Take one of N permit slots of a key (singleton_permits=N > 1), or hand this owner's own slot
-- over to a later generation of it, and issue a fencing token; unless the owner's message
-- already ran to its end (its completion record). Each slot is an ordinary lock (the hash
-- acquire.lua writes): renew.lua, release.lua and release_lost.lua work on it unchanged.
-- Under a rate limit (ARGV[5] > 0, core/rates.py) the same call also counts the key's starts
-- in a sliding window: at most ARGV[5] within any ARGV[6] ms; then the slots may be one (the
-- lock itself) or none (no limit on runs at once: a start takes nothing but its count).
--
-- KEYS[1]       the completion record of this owner (same hash slot as every key here)
-- KEYS[2]       the fencing counter shared by the slots: tokens increase across all of them
-- KEYS[3]       the rate record: a sorted set of the starts within the last period (member
--               'owner:generation', score the start's server time in ms), at most ARGV[5]
--               entries, expiring ARGV[6] ms after the last start; untouched without a rate
-- KEYS[4..]     the slots, in order (slot i is KEYS[i + 3])
-- ARGV[1..4]    owner, generation, lock ttl ms, fencing counter lifetime ms (as acquire.lua:
--               the counter expires ARGV[4] ms after its token, server clock)
-- ARGV[5]       the rate's limit: most starts within one period; 0: no rate
-- ARGV[6]       the rate's period, ms
-- ARGV[7..]     metadata written into the slot's hash: field, value, ...
-- return    {1, token, reentered, slot}                    slot taken (reentered 1: hand-over);
--                                                          {1, 0, 0, 0}: started, no slot
--           {0, holder, holder_gen, holder_token, pttl_ms, finished}
--                                                          every slot held (the holder whose
--                                                          slot expires first), or this owner
--                                                          holds one already with a generation
--                                                          not smaller (a redelivered copy)
--           {2, done_gen, record_pttl_ms}                  as acquire.lua
--           {3, wait_ms, last_owner, last_gen}             over the rate: nothing taken or
--                                                          counted; the next start is allowed
--                                                          in wait_ms (the oldest start leaves
--                                                          the window); the last start's owner
--
-- This owner's slot is looked for in all N before a free one is taken: a copy of a message
-- whose earlier delivery holds slot i must meet it, never take a second slot. A held key is a
-- duplicate before it is over the rate. A start of this owner and generation still in the
-- window (a broker's copy of a message that started, when no slot stands for its run) goes on
-- without counting twice.
local done = redis.call('GET', KEYS[1])
if done and tonumber(done) >= tonumber(ARGV[2]) then
  return {2, tonumber(done), redis.call('PTTL', KEYS[1])}
end

local free = nil
local first = nil
local first_pttl = nil
local slot = nil
local reentered = 0
for i = 4, #KEYS do
  local held = redis.call('HMGET', KEYS[i], 'owner', 'gen', 'token', 'ended')
  if not held[1] then
    if not free then
      free = i
    end
  elseif held[1] == ARGV[1] and not held[4] then
    if tonumber(ARGV[2]) <= tonumber(held[2]) then
      return {0, held[1], tonumber(held[2]), tonumber(held[3]), redis.call('PTTL', KEYS[i]), 0}
    end
    slot = i
    reentered = 1
    break
  else
    local pttl = redis.call('PTTL', KEYS[i])
    if not first or pttl < first_pttl then
      first, first_pttl = held, pttl
    end
  end
end
if not slot then
  slot = free
end
if #KEYS > 3 and not slot then
  local finished = 0
  if first[4] then
    finished = 1
  end
  return {0, first[1], tonumber(first[2]), tonumber(first[3]), first_pttl, finished}
end

local now = redis.call('TIME')
local now_us = tonumber(now[1]) * 1000000 + tonumber(now[2])
local now_ms = math.floor(now_us / 1000)
local limit = tonumber(ARGV[5])
if limit > 0 then
  local period = tonumber(ARGV[6])
  local member = ARGV[1] .. ':' .. ARGV[2]
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now_ms - period)
  if not redis.call('ZSCORE', KEYS[3], member) then
    if redis.call('ZCARD', KEYS[3]) >= limit then
      local oldest = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
      local last = redis.call('ZRANGE', KEYS[3], -1, -1)
      local owner, gen = string.match(last[1], '^(.*):(%d+)$')
      return {3, tonumber(oldest[2]) + period - now_ms, owner, tonumber(gen)}
    end
    redis.call('ZADD', KEYS[3], now_ms, member)
  end
  redis.call('PEXPIRE', KEYS[3], period)
  if not slot then
    return {1, 0, 0, 0}
  end
end

local token = (tonumber(redis.call('GET', KEYS[2])) or 0) + 1
if token < now_us then
  token = now_us
end
redis.call('SET', KEYS[2], string.format('%d', token), 'PX',
  tonumber(ARGV[4]) + math.floor((token - now_us) / 1000))

if #KEYS == 4 then  -- one slot: the lock itself, as acquire.lua writes it
  redis.call('HSET', KEYS[slot],
    'owner', ARGV[1], 'gen', ARGV[2], 'token', string.format('%d', token),
    'since', string.format('%d', now_ms), 'ttl', ARGV[3], unpack(ARGV, 7))
else
  redis.call('HSET', KEYS[slot],
    'owner', ARGV[1], 'gen', ARGV[2], 'token', string.format('%d', token),
    'since', string.format('%d', now_ms), 'ttl', ARGV[3],
    'permit', string.format('%d', slot - 3), 'permits', string.format('%d', #KEYS - 3),
    unpack(ARGV, 7))
end
redis.call('PEXPIRE', KEYS[slot], ARGV[3])
return {1, token, reentered, slot - 3}
