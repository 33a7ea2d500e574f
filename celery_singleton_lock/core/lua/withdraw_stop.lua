-- Withdraw a newer call's stop request from the lock it was written to (supersede.lua), when
-- that call ended while it waited (revoked): the holder goes on.
--
-- KEYS[1]   the lock (a hash written by acquire.lua; field 'cancel' names the newer call)
-- ARGV[1]   the newer call's task id
-- return    1 withdrawn; 0 the request names another call, or none
if redis.call('HGET', KEYS[1], 'cancel') == ARGV[1] then
  return redis.call('HDEL', KEYS[1], 'cancel')
end
return 0
