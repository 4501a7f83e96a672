"""What a server measures itself, and the profile it serves with: layer costs and tier bandwidths on
this machine, the packaged profile rescaled to it, a user's workload demand laid over it, and
demand measured on served requests in idle time. `cachesmith profile` (`profiler`) builds on it."""
