-- Release a lock only if the given run holds it: compare-and-delete on owner, generation, token.
-- A finished run also records its completion, and may keep the key blocked for a window.
--
-- KEYS[1]   the lock (a hash written by acquire.lua); its fencing counter is left alone
-- KEYS[2]   the completion record of the owner (same hash slot), read by acquire.lua
-- ARGV[1]   owner: the Celery task id
-- ARGV[2]   generation, or '' to match any generation of that owner
-- ARGV[3]   the fencing token the run got, or '' to match any token. With it, a redelivered copy
--           of the message (the same owner and generation) that took the lock after this run's
--           lock expired is another holder
-- ARGV[4]   keep the completion record this long, ms; 0: record nothing. Written whatever the
--           lock's state (the run finished either way), never lowering a recorded generation
-- ARGV[5]   at-least window, ms after the lock's 'since'; 0: none. While some of it is left the
--           lock is not deleted: it is marked 'ended' (server ms) and expires at its end
-- return    1 released (or turned into a window), 0 not held by any run (gone, or a window),
--           -1 held by another run (left alone)
local keep = tonumber(ARGV[4])
if keep and keep > 0 and ARGV[2] ~= '' then
  local recorded = tonumber(redis.call('GET', KEYS[2]))
  local gen = tonumber(ARGV[2])
  if recorded and recorded > gen then
    gen = recorded
  end
  redis.call('SET', KEYS[2], string.format('%d', gen), 'PX', keep)
end

local held = redis.call('HMGET', KEYS[1], 'owner', 'gen', 'token', 'ended', 'since')
if not held[1] or held[4] then
  return 0
end
if held[1] ~= ARGV[1] or (ARGV[2] ~= '' and held[2] ~= ARGV[2])
    or (ARGV[3] ~= '' and held[3] ~= ARGV[3]) then
  return -1
end
local at_least = tonumber(ARGV[5])
if at_least and at_least > 0 and held[5] then
  local now = redis.call('TIME')
  local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
  local left = tonumber(held[5]) + at_least - now_ms
  if left > 0 then
    redis.call('HSET', KEYS[1], 'ended', string.format('%d', now_ms))
    redis.call('PEXPIRE', KEYS[1], left)
    return 1
  end
end
redis.call('DEL', KEYS[1])
return 1
