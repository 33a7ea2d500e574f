-- Record joined duplicates as completed: a copy of one's message (its watch copy, a broker
-- redelivery) is then dropped by acquire.lua, not run. As release.lua records a run's end.
--
-- KEYS[1..] the completion record of each joiner (same hash slot as its lock)
-- ARGV[1]   keep each record this long, ms
-- ARGV[2..] the generation (retries count) of each joiner, in KEYS' order; a recorded larger
--           generation is kept
-- return    the number of records written
for i = 1, #KEYS do
  local gen = tonumber(ARGV[i + 1])
  local recorded = tonumber(redis.call('GET', KEYS[i]))
  if recorded and recorded > gen then
    gen = recorded
  end
  redis.call('SET', KEYS[i], string.format('%d', gen), 'PX', ARGV[1])
end
return #KEYS
