-- Give up a pending claim (publishing failed), so another instance can publish the run.
--
-- KEYS[1]   the run's claim key
-- ARGV[1]   claimer: the beat instance id that holds the pending claim
-- return    1 given up, 0 not this claimer's pending claim (left alone)
if redis.call('GET', KEYS[1]) ~= 'pending ' .. ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
return 1
