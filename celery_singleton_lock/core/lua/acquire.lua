-- Take a lock, or hand it over to a later generation of its owner, and issue a fencing token;
-- unless the owner's message already ran to its end (its completion record).
--
-- KEYS[1]   the lock: a hash with fields owner, gen, token, since, ttl and metadata; with a
--           field 'ended' it is an at-least window: the run finished, the key stays blocked
-- KEYS[2]   the fencing counter of that lock (same hash slot): expires ARGV[4] ms after its
--           token (server clock), so it outlives the lock by the margin unless renewed past it
-- KEYS[3]   the completion record of this owner (same hash slot): the largest generation of it
--           whose run finished (written by release.lua)
-- ARGV[1]   owner: the Celery task id
-- ARGV[2]   generation: the Celery retries count; the same owner with a LARGER generation re-enters
-- ARGV[3]   lock ttl, milliseconds
-- ARGV[4]   fencing counter lifetime, ms: the lock's ttl + the fence margin (backend.fence_ttl_ms)
-- ARGV[5..] metadata written into the lock hash: field, value, field, value, ...
-- return    {1, token, reentered}                          taken (reentered is 1 on a hand-over)
--           {0, holder, holder_gen, holder_token, pttl_ms, finished}
--                                                          held by another owner or generation,
--                                                          or a window (finished 1): no re-entry
--           {2, done_gen, record_pttl_ms}                  this owner's generation done_gen
--                                                          finished (>= ARGV[2]): nothing written
--
-- The token is max(counter + 1, server time in microseconds): strictly increasing per key,
-- and still increasing after the counter has expired: it expires once the clock has passed the
-- token by ARGV[4] (PX ARGV[4] plus how far the token is ahead of the clock, after a backward
-- step), so the next token, the clock, is larger unless the clock stepped back by more.
local done = redis.call('GET', KEYS[3])
if done and tonumber(done) >= tonumber(ARGV[2]) then
  return {2, tonumber(done), redis.call('PTTL', KEYS[3])}
end

local held = redis.call('HMGET', KEYS[1], 'owner', 'gen', 'token', 'ended')
local reentered = 0
if held[1] then
  if held[4] or held[1] ~= ARGV[1] or tonumber(ARGV[2]) <= tonumber(held[2]) then
    local finished = 0
    if held[4] then
      finished = 1
    end
    return {0, held[1], tonumber(held[2]), tonumber(held[3]), redis.call('PTTL', KEYS[1]), finished}
  end
  reentered = 1
end

local now = redis.call('TIME')
local now_us = tonumber(now[1]) * 1000000 + tonumber(now[2])
local token = (tonumber(redis.call('GET', KEYS[2])) or 0) + 1
if token < now_us then
  token = now_us
end
redis.call('SET', KEYS[2], string.format('%d', token), 'PX',
  tonumber(ARGV[4]) + math.floor((token - now_us) / 1000))

redis.call('HSET', KEYS[1],
  'owner', ARGV[1], 'gen', ARGV[2], 'token', string.format('%d', token),
  'since', string.format('%d', math.floor(now_us / 1000)),
  'ttl', ARGV[3], unpack(ARGV, 5))
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {1, token, reentered}
