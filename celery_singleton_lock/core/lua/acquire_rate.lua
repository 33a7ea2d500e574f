-- Take a lock (or one of N permit slots, or none: no limit on runs at once) under a sliding-
-- window rate limit: at most ARGV[5] starts of the key within any ARGV[6] ms. One call decides
-- both: a start over the rate takes nothing and is not counted. The lock part is acquire.lua's
-- (one slot) or acquire_permit.lua's (several), unchanged.
--
-- KEYS[1]       the completion record of this owner (same hash slot as every key here)
-- KEYS[2]       the fencing counter of the key's lock slots
-- KEYS[3]       the rate record: a sorted set of the starts within the last period (member
--               'owner:generation', score the start's server time in ms), at most ARGV[5]
--               entries, expiring ARGV[6] ms after its last start
-- KEYS[4..]     the lock slots, in order: one (the lock itself), N (permit slots), or none
-- ARGV[1..4]    owner, generation, lock ttl ms, fencing counter lifetime ms (as acquire.lua)
-- ARGV[5]       the limit: most starts within one period (>= 1)
-- ARGV[6]       the period, ms (>= 1)
-- ARGV[7..]     metadata written into the slot's hash: field, value, ...
-- return    {1, token, reentered, slot}                    started: the slot taken (0, token 0:
--                                                          no slot, runs at once are unlimited)
--           {0, holder, holder_gen, holder_token, pttl_ms, finished}
--                                                          every slot held: as acquire_permit.lua
--           {2, done_gen, record_pttl_ms}                  as acquire.lua
--           {3, wait_ms, last_owner, last_gen}             over the rate: the next start is
--                                                          allowed in wait_ms (when the oldest
--                                                          start leaves the window); the last
--                                                          start's owner and generation
--
-- A message whose start is in the window already (the same owner and generation: a redelivered
-- copy, when no slot stands for its run) starts again without counting twice.
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
local period = tonumber(ARGV[6])
local member = ARGV[1] .. ':' .. ARGV[2]
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now_ms - period)
if not redis.call('ZSCORE', KEYS[3], member) then
  if redis.call('ZCARD', KEYS[3]) >= tonumber(ARGV[5]) then
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

local token = (tonumber(redis.call('GET', KEYS[2])) or 0) + 1
if token < now_us then
  token = now_us
end
redis.call('SET', KEYS[2], string.format('%d', token), 'PX',
  tonumber(ARGV[4]) + math.floor((token - now_us) / 1000))

if #KEYS == 4 then
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
