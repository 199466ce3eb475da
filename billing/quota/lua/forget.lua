-- A crashed run's holds in a group it journaled nothing for (so nothing there is rebuilt): its
-- requests there had not started (reservations its journal never took: killed in between) or had
-- settled (their settlements lost with it). ARGV[2]: its registration, which will not come back.
redis.call('ZREM', p .. 'procs', ARGV[2])
drop_holds(function(owner, _) return owner == ARGV[2] end)
return 1
