-- Mark a claimed run as published, keeping the claim so no other instance publishes it.
--
-- KEYS[1]   the run's claim key
-- ARGV[1]   claimer: the beat instance id that holds the pending claim
-- ARGV[2]   the published task id
-- ARGV[3]   how long to keep the claim, milliseconds
-- return    1 confirmed, 0 the claim is no longer this claimer's pending claim (left alone)
if redis.call('GET', KEYS[1]) ~= 'pending ' .. ARGV[1] then
  return 0
end
redis.call('SET', KEYS[1], 'done ' .. ARGV[1] .. ' ' .. ARGV[2], 'PX', ARGV[3])
return 1
