-- Withdraw a joiner whose own message could not be kept (its watch copy was not published):
-- it is requeued instead, and must not be completed as well.
--
-- KEYS[1]   the lock's joiners (as join.lua writes them)
-- ARGV[1]   the joiner's task id
-- return    1 withdrawn; 0 already taken (a run's end completes it)
return redis.call('HDEL', KEYS[1], ARGV[1])
