"""zerolab: the bench around ``zero``, not part of ZeRO itself.

What the tests, the benchmarks and the notes' figures need to run and measure the stages:
``launch`` (local ranks, forked), ``models`` (small models), ``systems`` (DDP, FSDP2 and ours
built alike), ``trackers`` (memory, torch's MemTracker extended) and ``measure`` (bytes sent,
torch's CommDebugMode extended). A learner reads ``zero/``; this package is the lab bench.
"""
