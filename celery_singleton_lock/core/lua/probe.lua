-- Read what acquire.lua (one slot) or acquire_permit.lua (N slots) would answer this owner,
-- without writing anything: the worker's main process asks it before it turns a duplicate away.
--
-- KEYS[1]       the completion record of this owner (as acquire_permit.lua's KEYS[1])
-- KEYS[2..N+1]  the lock's slots, in order: the lock itself for one permit
-- ARGV[1]       owner: the Celery task id
-- ARGV[2]       generation: the Celery retries count
-- return    {1}                                              a run would take a slot, or
--                                                            re-enter its own
--           {0, holder, holder_gen, holder_token, pttl_ms, finished}
--                                                            every slot held: as the acquire
--                                                            scripts answer (the holder whose
--                                                            slot expires first)
--           {2, done_gen, record_pttl_ms}                    this owner's message completed
--
-- The same decisions as acquire_permit.lua, whose rules for one slot are acquire.lua's.
local done = redis.call('GET', KEYS[1])
if done and tonumber(done) >= tonumber(ARGV[2]) then
  return {2, tonumber(done), redis.call('PTTL', KEYS[1])}
end

local first = nil
local first_pttl = nil
for i = 2, #KEYS do
  local held = redis.call('HMGET', KEYS[i], 'owner', 'gen', 'token', 'ended')
  if not held[1] then
    return {1}
  end
  if held[1] == ARGV[1] and not held[4] then
    if tonumber(ARGV[2]) <= tonumber(held[2]) then
      return {0, held[1], tonumber(held[2]), tonumber(held[3]), redis.call('PTTL', KEYS[i]), 0}
    end
    return {1}
  end
  local pttl = redis.call('PTTL', KEYS[i])
  if not first or pttl < first_pttl then
    first, first_pttl = held, pttl
  end
end
local finished = 0
if first[4] then
  finished = 1
end
return {0, first[1], tonumber(first[2]), tonumber(first[3]), first_pttl, finished}
