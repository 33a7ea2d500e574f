-- Claim scheduled runs for one beat instance, for long enough to publish them: one run, or many
-- at once (the runs a beat tick found due; on a Redis Cluster, one run per call).
--
-- KEYS[4i-3]  run i's claim key (entry name + run id)
-- KEYS[4i-2]  run i's witness key: set by the first worker that received one of its messages
-- KEYS[4i-1]  its entry's pause: set while an operator has the entry paused
-- KEYS[4i]    its entry's record (a hash): `through`, the nominal time (epoch ms) up to which
--             the entry's runs are accounted for (published, or passed over while paused), and
--             the last published nominal run: `nominal`, `by`, `at` (epoch ms), `task`
-- ARGV[1]     claimer: the beat instance id
-- ARGV[2]     publish lease, milliseconds: how long a claim may stay unconfirmed
-- ARGV[4i-1]  how long to keep run i's claim once it is known published, milliseconds
-- ARGV[4i]    run i's nominal time, epoch ms, or "" (a run not at a nominal time: not recorded)
-- ARGV[4i+1]  how long to keep the entry's record, milliseconds
-- ARGV[4i+2]  "1": a paused entry's run is passed over; "0": it is claimed all the same
-- return      one reply per run, in order:
--             {1}                  claimed; publish, then confirm.lua
--             {0, value, pttl_ms}  already claimed: value is "pending <id>" or "done <id> <task id>"
--                                  (a run a worker received, whose claim expired unconfirmed,
--                                  is marked "done witness <task id>" here)
--             {2, pause}           the entry is paused: the pause's value ("<by> <at ms>")
--
-- A claim pending under the claimer's own id is its own (an earlier claim ran here but its reply
-- was lost, or the beat claims again runs it has not published yet): it is claimed again, with a
-- fresh lease, instead of being waited out.
local mine = 'pending ' .. ARGV[1]

-- the entry's runs up to `nominal` are accounted for
local function account(record, nominal, keep)
  if nominal == '' then
    return
  end
  local through = tonumber(redis.call('HGET', record, 'through'))
  if not through or tonumber(nominal) > through then
    redis.call('HSET', record, 'through', nominal)
  end
  redis.call('PEXPIRE', record, keep)
end

local replies = {}
for i = 1, #KEYS / 4 do
  local claim, seen, pause, record = KEYS[4 * i - 3], KEYS[4 * i - 2], KEYS[4 * i - 1], KEYS[4 * i]
  local keep, nominal, record_keep = ARGV[4 * i - 1], ARGV[4 * i], ARGV[4 * i + 1]
  local value = redis.call('GET', claim)
  if value == mine then
    redis.call('PEXPIRE', claim, ARGV[2])
    replies[i] = {1}
  elseif value then
    replies[i] = {0, value, redis.call('PTTL', claim)}
  else
    local paused = ARGV[4 * i + 2] == '1' and redis.call('GET', pause)
    local received = redis.call('GET', seen)
    if paused then
      account(record, nominal, record_keep)
      replies[i] = {2, paused}
    elseif received then
      value = 'done witness ' .. received
      redis.call('SET', claim, value, 'PX', keep)
      account(record, nominal, record_keep)
      replies[i] = {0, value, tonumber(keep)}
    else
      redis.call('SET', claim, mine, 'PX', ARGV[2])
      replies[i] = {1}
    end
  end
end
return replies
