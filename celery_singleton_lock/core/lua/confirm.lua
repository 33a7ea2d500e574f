-- Mark claimed runs as published, keeping their claims so no other instance publishes them: one
-- run, or many at once (on a Redis Cluster, one run per call).
--
-- KEYS[i]       run i's claim key
-- ARGV[1]       claimer: the beat instance id that holds the pending claims
-- ARGV[2i]      run i's published task id
-- ARGV[2i+1]    how long to keep run i's claim, milliseconds
-- return        one reply per run, in order: 1 confirmed, 0 the claim is no longer this
--               claimer's pending claim (left alone)
local mine = 'pending ' .. ARGV[1]
local replies = {}
for i = 1, #KEYS do
  if redis.call('GET', KEYS[i]) == mine then
    redis.call('SET', KEYS[i], 'done ' .. ARGV[1] .. ' ' .. ARGV[2 * i], 'PX', ARGV[2 * i + 1])
    replies[i] = 1
  else
    replies[i] = 0
  end
end
return replies
