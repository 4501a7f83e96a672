"""`cachesmith profile`: a profile's demand measured offline on a task's or a workload file's requests."""
