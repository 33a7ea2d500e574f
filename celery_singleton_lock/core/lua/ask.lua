-- An operator asks the beats of a group to publish one run of an entry now (`celery singleton
-- beat run`): the ask is kept unless a live one for the entry is there already, which is then
-- the one that goes out (two operators asking at once get one run).
--
-- KEYS[1]  the group's asks (a hash: entry name -> "<ask id> <by> <at ms> <until ms>")
-- ARGV[1]  entry name
-- ARGV[2]  the new ask's value
-- ARGV[3]  now, epoch ms: an ask whose `until` passed is dead, and replaced
-- ARGV[4]  how long to keep the hash, milliseconds
-- return   the entry's live ask: the new one, or the one found
local found = redis.call('HGET', KEYS[1], ARGV[1])
if found then
  local until_ms = tonumber(string.match(found, '(%d+)$'))
  if until_ms and until_ms > tonumber(ARGV[3]) then
    return found
  end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return ARGV[2]
