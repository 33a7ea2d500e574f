-- Latest wins (singleton_on_duplicate="cancel"): a newer call of a key takes the place of every
-- call waiting for it, and asks the run holding it to stop (the lock's field 'cancel', which
-- renew.lua reports to the holder). In 'run' mode the call holds the key already (it found it
-- free): the older waiting calls only make way for it.
--
-- KEYS[1]   the key's queue (a sorted set, as enqueue.lua writes it)
-- KEYS[2]   the queued calls (a hash, as enqueue.lua writes it)
-- KEYS[3]   the lock (one permit: the key itself)
-- ARGV[1]   the newer call's task id
-- ARGV[2]   its retries count
-- ARGV[3]   its record (opaque bytes: what publishing it again needs)
-- ARGV[4]   keep the queue this long past the lock's expiry, ms
-- ARGV[5]   its task name
-- ARGV[6]   'wait': it waits for the key (queued, the holder asked to stop); 'run': it holds it
-- return    {1, id, '<retries>|<record>', ...}  done; the older calls it superseded, taken out
--           {0, pttl_ms, finished}              'wait', and the key is free (pttl -2) or in an
--                                               at-least window: nothing written
local held = redis.call('HMGET', KEYS[3], 'owner', 'ended')
if ARGV[6] == 'wait' and (not held[1] or held[2]) then
  local finished = 0
  if held[2] then
    finished = 1
  end
  return {0, redis.call('PTTL', KEYS[3]), finished}
end
local out = {1}
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if id ~= ARGV[1] then
    local call = redis.call('HGET', KEYS[2], id)
    redis.call('ZREM', KEYS[1], id)
    redis.call('HDEL', KEYS[2], id)
    if call then
      out[#out + 1] = id
      out[#out + 1] = call
    end
  end
end
if ARGV[6] == 'wait' then
  if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then
    local place = redis.call('HINCRBY', KEYS[2], '#', 1)
    redis.call('ZADD', KEYS[1], place, ARGV[1])
  end
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[2] .. '|' .. ARGV[3], 'task', ARGV[5], 'slots', 1)
  redis.call('HSET', KEYS[3], 'cancel', ARGV[1])
  local keep = math.max(redis.call('PTTL', KEYS[3]), 0) + tonumber(ARGV[4])
  for i = 1, 2 do
    if redis.call('PTTL', KEYS[i]) < keep then
      redis.call('PEXPIRE', KEYS[i], keep)
    end
  end
elseif redis.call('ZCARD', KEYS[1]) == 0 then
  redis.call('DEL', KEYS[2])
end
return out
