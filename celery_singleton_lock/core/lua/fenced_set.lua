-- Write a value only if the writer's fencing token is newer than the last accepted one.
--
-- KEYS[1]   the guarded record: a hash with fields value and token
-- ARGV[1]   the value to write
-- ARGV[2]   the writer's fencing token (a decimal integer)
-- ARGV[3]   ttl of the record in milliseconds, or 0 to keep it without expiry
-- return    {1, token}            written
--           {0, accepted_token}   rejected: a write with this or a newer token already landed
local accepted = redis.call('HGET', KEYS[1], 'token')
if accepted and tonumber(accepted) >= tonumber(ARGV[2]) then
  return {0, tonumber(accepted)}
end
redis.call('HSET', KEYS[1], 'value', ARGV[1], 'token', ARGV[2])
if tonumber(ARGV[3]) > 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
end
return {1, tonumber(ARGV[2])}
