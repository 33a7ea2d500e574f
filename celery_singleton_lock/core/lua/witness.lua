-- A worker received a message of one scheduled run: is it the run's first message?
--
-- A beat instance that dies between publishing a run and confirming its claim leaves the
-- claim pending; another instance publishes the run again once the claim expires. The
-- first message a worker receives is witnessed here, and a later one (another task id) is
-- the duplicate. The same task id again is a redelivery of the first message: it runs.
--
-- KEYS[1]   the run's witness key
-- ARGV[1]   the received message's task id
-- ARGV[2]   how long to keep the witness, milliseconds
-- return    "" when this message is the run's first (or a redelivery of it): run it;
--           else the task id of the run's first message: drop this one
local first = redis.call('GET', KEYS[1])
if not first then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return ''
end
if first == ARGV[1] then
  return ''
end
return first
