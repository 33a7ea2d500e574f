-- Delete a queued marker only if it names the given task id: compare-and-delete.
--
-- KEYS[1]   the queued marker (written by publish.lua)
-- ARGV[1]   the task id: the message that started, was revoked, expired or failed to publish
-- return    1 deleted, 0 absent, -1 names another task id (left alone)
local queued = redis.call('GET', KEYS[1])
if not queued then
  return 0
end
if queued ~= ARGV[1] then
  return -1
end
redis.call('DEL', KEYS[1])
return 1
