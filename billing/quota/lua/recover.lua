-- A restarted process replays rows its crashed run settled (the counters may have counted them, or
-- lost them in a failover while it was down): the group is rebuilt as after a failover. Every process
-- registered here re-registers its running holds and its rows not yet in the ledger, admissions wait
-- for them (up to ARGV[3] ms), then the counters come from the ledger and those rows. ARGV[2]: the
-- crashed run's own registration, which will not come back (the restarted process registers anew).
redis.call('ZREM', p .. 'procs', ARGV[2])
-- The crashed run's holds still here: its interrupted requests' were released before this call
-- (with what their rows say), so the rest had settled and their settlements were lost.
if ARGV[2] ~= '' then drop_holds(function(owner, _) return owner == ARGV[2] end) end
redis.call('ZUNIONSTORE', p .. 'procs:stale', 2, p .. 'procs:stale', p .. 'procs')
redis.call('DEL', p .. 'procs')
redis.call('SET', p .. 'recovering', '1', 'PX', ARGV[3])
redis.call('INCR', p .. 'epoch')
return 1
