-- Release a run's lock (or its permit slot) as release.lua does, and hand it straight to the
-- call at the head of the key's queue, if one waits: the lock is rewritten in that call's name
-- (its task id, and its retries count less one, so that its own message re-enters it with a
-- fresh fencing token: acquire.lua), so no newer call can take the key before it. Atomic: a
-- call queued before this release is handed the key, one queued after it never finds it free.
--
-- KEYS[1]   the lock, or the run's permit slot (a hash written by acquire.lua)
-- KEYS[2]   the completion record of the owner (same hash slot), as release.lua writes it
-- KEYS[3]   the key's queue (a sorted set, as enqueue.lua writes it)
-- KEYS[4]   the queued calls (a hash, as enqueue.lua writes it)
-- ARGV[1]   owner: the Celery task id of the run that ended
-- ARGV[2]   its generation
-- ARGV[3]   the fencing token it got, or '' to match any token
-- ARGV[4]   keep its completion record this long, ms; 0: record nothing
-- ARGV[5]   how long the lock waits, in the head's name, for the head's message, ms
-- ARGV[6]   keep the queue this long past that, ms
-- return    {1}                     released, no call waits (the empty queue's calls hash deleted)
--           {3, id, retries, record} released and handed to the queue's head: publish it
--           {0}                     not held by any run (gone); the queue is left as it is
--           {-1}                    held by another run (left alone)
local keep = tonumber(ARGV[4])
if keep and keep > 0 then
  local recorded = tonumber(redis.call('GET', KEYS[2]))
  local gen = tonumber(ARGV[2])
  if recorded and recorded > gen then
    gen = recorded
  end
  redis.call('SET', KEYS[2], string.format('%d', gen), 'PX', keep)
end
local held = redis.call('HMGET', KEYS[1], 'owner', 'gen', 'token', 'ended')
if not held[1] or held[4] then
  return {0}
end
if held[1] ~= ARGV[1] or held[2] ~= ARGV[2] or (ARGV[3] ~= '' and held[3] ~= ARGV[3]) then
  return {-1}
end
while true do
  local head = redis.call('ZRANGE', KEYS[3], 0, 0)
  if #head == 0 then
    redis.call('DEL', KEYS[1], KEYS[4])
    return {1}
  end
  local id = head[1]
  redis.call('ZREM', KEYS[3], id)
  local call = redis.call('HGET', KEYS[4], id)
  redis.call('HDEL', KEYS[4], id)
  if call then
    local bar = string.find(call, '|', 1, true)
    local retries = string.sub(call, 1, bar - 1)
    local now = redis.call('TIME')
    redis.call('DEL', KEYS[1])
    redis.call('HSET', KEYS[1], 'owner', id, 'gen', string.format('%d', tonumber(retries) - 1),
      'token', held[3], 'since', string.format('%d', tonumber(now[1]) * 1000
        + math.floor(tonumber(now[2]) / 1000)), 'ttl', ARGV[5], 'queued', '1')
    redis.call('PEXPIRE', KEYS[1], ARGV[5])
    local stay = tonumber(ARGV[5]) + tonumber(ARGV[6])
    for i = 3, 4 do
      if redis.call('PTTL', KEYS[i]) < stay then
        redis.call('PEXPIRE', KEYS[i], stay)
      end
    end
    return {3, id, tonumber(retries), string.sub(call, bar + 1)}
  end
end
