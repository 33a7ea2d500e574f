-- Forget an operator's ask for a run now (published, dead, or withdrawn), unless another ask for
-- the same entry took its place.
--
-- KEYS[1]  the group's asks (a hash: entry name -> "<ask id> <by> <at ms> <until ms>")
-- ARGV[1]  entry name
-- ARGV[2]  the ask's value
-- return   1 if it was forgotten, 0 if the entry's ask is another one (or none)
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  return redis.call('HDEL', KEYS[1], ARGV[1])
end
return 0
