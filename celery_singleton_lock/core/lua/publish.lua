-- Publish-time dedup: find the queued or running holder of a lock, or mark a new message queued.
--
-- KEYS[1]   the lock (a hash written by acquire.lua)
-- KEYS[2]   the queued marker of that lock (same hash slot): a string, the queued task id
-- ARGV[1]   the task id about to be published
-- ARGV[2]   marker ttl, milliseconds
-- ARGV[3]   a task id known to be finished (its result is ready), or '': a marker naming it
--           is stale and is taken over
-- return    {1}                       marked: publish the message
--           {0, holder, 'running'}    another task id holds the lock
--           {0, holder, 'finished'}   another task id's finished run holds its at-least window
--           {0, holder, 'queued'}     another task id is queued (marked, not yet started)
--
-- The same task id again (a retry or a requeue of the message) is never its own duplicate.
local held = redis.call('HMGET', KEYS[1], 'owner', 'ended')
local owner = held[1]
if owner and owner ~= ARGV[1] then
  if held[2] then
    return {0, owner, 'finished'}
  end
  return {0, owner, 'running'}
end
local queued = redis.call('GET', KEYS[2])
if queued and queued ~= ARGV[1] and queued ~= ARGV[3] then
  return {0, queued, 'queued'}
end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
return {1}
