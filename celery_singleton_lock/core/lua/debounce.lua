-- Debounce a call of a key: the calls made within S ms of each other form a burst, and only
-- the burst's latest call runs, S ms after it was made (at the latest M ms after the burst's
-- first call); every earlier call of the burst is superseded. Called once when a call's
-- message arrives ('call') and once when the copy it left waiting comes due ('due').
--
-- KEYS[1]   the key's debounce state (same hash slot as the lock): a hash with
--             latest   the task id of the burst's latest call
--             first    when the burst's first call arrived, ms
--             due      when latest runs, ms
--             count    the calls of the burst
--             fired    '1' once latest came due: the burst is over
--             c:<id>   one per call registered whose copy has not come due yet: '1', or 'r'
--                      for the latest call of an earlier burst (due, it runs when it comes)
-- KEYS[2]   the call's completion record (same hash slot, as release.lua writes it)
-- KEYS[3..] the lock (a hash written by acquire.lua), or the N permit slots of the key
-- ARGV[1]   'call': the call's message arrived; 'due': the copy it left waiting came due
-- ARGV[2]   the call's task id
-- ARGV[3]   S, ms (> 0)
-- ARGV[4]   M, ms (0: no cap)
-- ARGV[5]   keep the state this long past the burst's due, ms
-- ARGV[6]   now, ms ('': the server's clock)
-- ARGV[7]   the call's generation (its retries count)
-- return    {0, countdown ms, calls}  wait: the call is its burst's latest; it runs in countdown
--           {1, 0, ''}                run: the call is due (or already ran or runs: the lock
--                                     and its completion record decide it)
--           {2, 0, by}                superseded by the call `by`, the latest of its burst
local now
if ARGV[6] ~= '' then
  now = tonumber(ARGV[6])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local id = ARGV[2]
local state = redis.call('HMGET', KEYS[1], 'latest', 'first', 'due', 'count', 'fired', 'c:' .. id)
local latest, first, due, count, fired, mine = state[1], tonumber(state[2]),
  tonumber(state[3]), tonumber(state[4]), state[5], state[6]
if latest == id or mine == 'r' then
  if ARGV[1] == 'call' and latest == id and not fired and now < due then
    return {0, due - now, count}  -- a redelivery of the call: it still waits
  end
  if latest == id then
    redis.call('HSET', KEYS[1], 'fired', '1')
  end
  redis.call('HDEL', KEYS[1], 'c:' .. id)
  return {1, 0, ''}
end
-- a call that ran, or runs, is never superseded afterwards (a redelivered copy of it)
local done = tonumber(redis.call('GET', KEYS[2]))
if done and done >= tonumber(ARGV[7]) then
  return {1, 0, ''}
end
for i = 3, #KEYS do
  if redis.call('HGET', KEYS[i], 'owner') == id then
    return {1, 0, ''}
  end
end
if latest and (ARGV[1] == 'due' or mine) then
  redis.call('HDEL', KEYS[1], 'c:' .. id)
  return {2, 0, latest}
end
-- a new call of the burst (or the first of a new one; or a copy whose state expired)
if not latest or fired or now >= due then
  if latest and not fired then
    redis.call('HSET', KEYS[1], 'c:' .. latest, 'r')  -- still runs when its copy comes
  end
  redis.call('HDEL', KEYS[1], 'fired')
  first, count = now, 0
end
count = count + 1
due = now + tonumber(ARGV[3])
local cap = tonumber(ARGV[4])
if cap > 0 and first + cap < due then
  due = math.max(first + cap, now)
end
redis.call('HSET', KEYS[1], 'latest', id, 'first', first, 'due', due, 'count', count,
  'c:' .. id, '1')
redis.call('PEXPIRE', KEYS[1], due - now + tonumber(ARGV[5]))
return {0, due - now, count}
