-- Release a lock only if the given owner (and generation) holds it: compare-and-delete.
--
-- KEYS[1]   the lock (a hash written by acquire.lua); its fencing counter is left alone
-- ARGV[1]   owner: the Celery task id
-- ARGV[2]   generation, or '' to match any generation of that owner (used by the worker's
--           main process, which does not know how often a dead child's task was retried)
-- return    1 released, 0 not held by anyone, -1 held by another owner or generation (left alone)
local held = redis.call('HMGET', KEYS[1], 'owner', 'gen')
if not held[1] then
  return 0
end
if held[1] ~= ARGV[1] or (ARGV[2] ~= '' and held[2] ~= ARGV[2]) then
  return -1
end
redis.call('DEL', KEYS[1])
return 1
