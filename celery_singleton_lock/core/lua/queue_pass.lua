-- Pass a key to the call at the head of its queue when no run's end does: the lock (or a slot)
-- is free, its run lost (the worker's main process released it, or it expired); or it waits in
-- the name of a queued call that will not run (revoked, expired, already ended: its message is
-- discarded). The lock is rewritten in the head's name, as queue_release.lua does.
--
-- KEYS[1]   the lock, or one of its permit slots
-- KEYS[2]   the key's queue (a sorted set, as enqueue.lua writes it)
-- KEYS[3]   the queued calls (a hash, as enqueue.lua writes it)
-- ARGV[1]   the queued call the lock waits for, to be passed over; '': the lock must be free
-- ARGV[2]   how long the lock waits, in the next head's name, for its message, ms
-- ARGV[3]   keep the queue this long past that, ms
-- return    {3, id, retries, record} handed to the queue's head: publish it
--           {1}                      the lock was the passed call's, and no call waits: freed
--           {0}                      nothing done: the lock is held (by another run, or not in
--                                    the passed call's name), or no call waits
local held = redis.call('HMGET', KEYS[1], 'owner', 'token', 'queued')
if ARGV[1] == '' then
  if held[1] then
    return {0}
  end
elseif held[1] ~= ARGV[1] or not held[3] then
  return {0}
end
while true do
  local head = redis.call('ZRANGE', KEYS[2], 0, 0)
  if #head == 0 then
    redis.call('DEL', KEYS[3])
    if held[1] then
      redis.call('DEL', KEYS[1])
      return {1}
    end
    return {0}
  end
  local id = head[1]
  redis.call('ZREM', KEYS[2], id)
  local call = redis.call('HGET', KEYS[3], id)
  redis.call('HDEL', KEYS[3], id)
  if call then
    local bar = string.find(call, '|', 1, true)
    local retries = string.sub(call, 1, bar - 1)
    local now = redis.call('TIME')
    redis.call('DEL', KEYS[1])
    redis.call('HSET', KEYS[1], 'owner', id, 'gen', string.format('%d', tonumber(retries) - 1),
      'token', held[2] or '0', 'since', string.format('%d', tonumber(now[1]) * 1000
        + math.floor(tonumber(now[2]) / 1000)), 'ttl', ARGV[2], 'queued', '1')
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    local stay = tonumber(ARGV[2]) + tonumber(ARGV[3])
    for i = 2, 3 do
      if redis.call('PTTL', KEYS[i]) < stay then
        redis.call('PEXPIRE', KEYS[i], stay)
      end
    end
    return {3, id, tonumber(retries), string.sub(call, bar + 1)}
  end
end
