-- Claim scheduled runs for one beat instance, for long enough to publish them: one run, or many
-- at once (the runs a beat tick found due; on a Redis Cluster, one run per call).
--
-- KEYS[2i-1]  run i's claim key (entry name + nominal run time)
-- KEYS[2i]    run i's witness key: set by the first worker that received one of its messages
-- ARGV[1]     claimer: the beat instance id
-- ARGV[2]     publish lease, milliseconds: how long a claim may stay unconfirmed
-- ARGV[2+i]   how long to keep run i's claim once it is known published, milliseconds
-- return      one reply per run, in order:
--             {1}                  claimed; publish, then confirm.lua
--             {0, value, pttl_ms}  already claimed: value is "pending <id>" or "done <id> <task id>"
--                                  (a run a worker received, whose claim expired unconfirmed,
--                                  is marked "done witness <task id>" here)
--
-- A claim pending under the claimer's own id is its own (an earlier claim ran here but its reply
-- was lost, or the beat claims again runs it has not published yet): it is claimed again, with a
-- fresh lease, instead of being waited out.
local mine = 'pending ' .. ARGV[1]
local replies = {}
for i = 1, #KEYS / 2 do
  local claim, seen = KEYS[2 * i - 1], KEYS[2 * i]
  local value = redis.call('GET', claim)
  if value == mine then
    redis.call('PEXPIRE', claim, ARGV[2])
    replies[i] = {1}
  elseif value then
    replies[i] = {0, value, redis.call('PTTL', claim)}
  else
    local received = redis.call('GET', seen)
    if received then
      value = 'done witness ' .. received
      redis.call('SET', claim, value, 'PX', ARGV[2 + i])
      replies[i] = {0, value, tonumber(ARGV[2 + i])}
    else
      redis.call('SET', claim, mine, 'PX', ARGV[2])
      replies[i] = {1}
    end
  end
end
return replies
