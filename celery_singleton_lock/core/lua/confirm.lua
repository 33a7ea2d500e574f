-- Mark claimed runs as published, keeping their claims so no other instance publishes them, and
-- note each in its entry's record: one run, or many at once (on a Redis Cluster, one run per
-- call).
--
-- KEYS[2i-1]    run i's claim key
-- KEYS[2i]      its entry's record (a hash, see claim.lua)
-- ARGV[1]       claimer: the beat instance id that holds the pending claims
-- ARGV[4i-2]    run i's published task id
-- ARGV[4i-1]    how long to keep run i's claim, milliseconds
-- ARGV[4i]      run i's nominal time, epoch ms, or "" (a run not at a nominal time: not recorded)
-- ARGV[4i+1]    how long to keep the entry's record, milliseconds
-- return        one reply per run, in order: 1 confirmed, 0 the claim is no longer this
--               claimer's pending claim (left alone)
local mine = 'pending ' .. ARGV[1]
local replies = {}
for i = 1, #KEYS / 2 do
  local claim, record = KEYS[2 * i - 1], KEYS[2 * i]
  local task, nominal = ARGV[4 * i - 2], ARGV[4 * i]
  if redis.call('GET', claim) == mine then
    redis.call('SET', claim, 'done ' .. ARGV[1] .. ' ' .. task, 'PX', ARGV[4 * i - 1])
    if nominal ~= '' then
      local n = tonumber(nominal)
      local through = tonumber(redis.call('HGET', record, 'through'))
      if not through or n > through then
        redis.call('HSET', record, 'through', nominal)
      end
      local last = tonumber(redis.call('HGET', record, 'nominal'))
      if not last or n >= last then
        local now = redis.call('TIME')
        local at = tostring(tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000))
        redis.call('HSET', record, 'nominal', nominal, 'by', ARGV[1], 'at', at, 'task', task)
      end
      redis.call('PEXPIRE', record, ARGV[4 * i + 1])
    end
    replies[i] = 1
  else
    replies[i] = 0
  end
end
return replies
