"""The real node agent: POPPA's shutters (Seed 002, Alg. 1-3) on real processes.

* ``processes``: process identities that survive PID reuse, and the guard that decides what may be signalled;
* ``pausing``: the cgroup freezer or SIGSTOP/SIGCONT through pidfds, behind one interface;
* ``watchdog``: an independent process that resumes whatever the agent paused if the agent dies;
* ``progress``: progress counters (hardware via perf_event_open, or an application counter);
* ``rapl``: processor power from /sys/class/powercap, or an honest "unavailable";
* ``spool``: store-and-forward to local disk while the broker is unreachable;
* ``jobs``: which jobs run here (a static job file, or Slurm);
* ``shutter``: the pure parts of a cycle (rotation, samples, blocks);
* ``agent``: the loop that ties them together.
"""
