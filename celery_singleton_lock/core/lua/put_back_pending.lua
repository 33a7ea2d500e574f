-- Put a taken follow-up back after its publish failed, unless a newer one was left meanwhile
-- (that one carries later arguments and is published instead).
--
-- KEYS[1]   the pending follow-up
-- ARGV[1]   keep it this long, ms
-- ARGV[2..] the record: field, value, field, value, ...
-- return    1 put back, 0 a newer record is there (left alone)
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
