-- Release a lock only if the given run holds it: compare-and-delete on owner, generation, token.
--
-- KEYS[1]   the lock (a hash written by acquire.lua); its fencing counter is left alone
-- ARGV[1]   owner: the Celery task id
-- ARGV[2]   generation, or '' to match any generation of that owner
-- ARGV[3]   the fencing token the run got, or '' to match any token. With it, a redelivered copy
--           of the message (the same owner and generation) that took the lock after this run's
--           lock expired is another holder
-- return    1 released, 0 not held by anyone, -1 held by another run (left alone)
local held = redis.call('HMGET', KEYS[1], 'owner', 'gen', 'token')
if not held[1] then
  return 0
end
if held[1] ~= ARGV[1] or (ARGV[2] ~= '' and held[2] ~= ARGV[2])
    or (ARGV[3] ~= '' and held[3] ~= ARGV[3]) then
  return -1
end
redis.call('DEL', KEYS[1])
return 1
