-- Take one of N permit slots of a key (singleton_permits=N > 1), or hand this owner's own slot
-- over to a later generation of it, and issue a fencing token; unless the owner's message
-- already ran to its end (its completion record). Each slot is an ordinary lock (the hash
-- acquire.lua writes): renew.lua, release.lua and release_lost.lua work on it unchanged.
--
-- KEYS[1]       the completion record of this owner (same hash slot as every lock key)
-- KEYS[2]       the fencing counter shared by the N slots: tokens increase across all of them
-- KEYS[3..N+2]  the N slots, in order (slot i is KEYS[i + 2])
-- ARGV[1..4]    owner, generation, lock ttl ms, fencing counter lifetime ms (as acquire.lua:
--               the counter expires ARGV[4] ms after its token, server clock)
-- ARGV[5..]     metadata written into the slot's hash: field, value, ...
-- return    {1, token, reentered, slot}                    slot taken (reentered 1: hand-over)
--           {0, holder, holder_gen, holder_token, pttl_ms, finished}
--                                                          every slot held (the holder whose
--                                                          slot expires first), or this owner
--                                                          holds one already with a generation
--                                                          not smaller (a redelivered copy)
--           {2, done_gen, record_pttl_ms}                  as acquire.lua
--
-- This owner's slot is looked for in all N before a free one is taken: a copy of a message
-- whose earlier delivery holds slot i must meet it, never take a second slot.
local done = redis.call('GET', KEYS[1])
if done and tonumber(done) >= tonumber(ARGV[2]) then
  return {2, tonumber(done), redis.call('PTTL', KEYS[1])}
end

local free = nil
local first = nil
local first_pttl = nil
local slot = nil
local reentered = 0
for i = 3, #KEYS do
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
if not slot then
  local finished = 0
  if first[4] then
    finished = 1
  end
  return {0, first[1], tonumber(first[2]), tonumber(first[3]), first_pttl, finished}
end

local now = redis.call('TIME')
local now_us = tonumber(now[1]) * 1000000 + tonumber(now[2])
local token = (tonumber(redis.call('GET', KEYS[2])) or 0) + 1
if token < now_us then
  token = now_us
end
redis.call('SET', KEYS[2], string.format('%d', token), 'PX',
  tonumber(ARGV[4]) + math.floor((token - now_us) / 1000))

redis.call('HSET', KEYS[slot],
  'owner', ARGV[1], 'gen', ARGV[2], 'token', string.format('%d', token),
  'since', string.format('%d', math.floor(now_us / 1000)),
  'ttl', ARGV[3], 'permit', string.format('%d', slot - 2),
  'permits', string.format('%d', #KEYS - 2), unpack(ARGV, 5))
redis.call('PEXPIRE', KEYS[slot], ARGV[3])
return {1, token, reentered, slot - 2}
