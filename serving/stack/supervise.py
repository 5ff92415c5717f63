"""`pddjax up`'s supervisor: a service that exits is started again, not the stack torn down.

The same command on the same port (P, RLD, the links and the router keep reaching it at the
address they were given), after a backoff that doubles with each restart of that service
(RESTART_BACKOFF_S .. MAX_BACKOFF_S). A service that exits MAX_RESTARTS times within WINDOW_S
is given up; the stack stops once a role has no instance left that runs or will run again.
While an engine service restarts (it precompiles before SERVING), the router's health checks
take it out of the rotation and its peers serve on.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import time

RESTART_BACKOFF_S, MAX_BACKOFF_S = 1.0, 30.0
MAX_RESTARTS, WINDOW_S = 5, 300.0


class Supervisor:
    def __init__(self, children: list, now=time.monotonic):
        """`children`: up.Child objects (role, proc, address, ready_file, restarting, relaunch())."""
        self.children, self.now = children, now
        self.exits: dict[int, collections.deque] = collections.defaultdict(collections.deque)  # id(child) -> times
        self.due: dict[int, float] = {}  # id(child) -> when to start it again
        self.given_up: set[int] = set()
        self.restarts = 0

    def poll(self) -> list[str]:
        """Once a second: notes exits, restarts what is due, reports a restarted service that is
        ready again -> the roles with nothing left (the stack stops)."""
        now = self.now()
        for c in self.children:
            key = id(c)
            if key in self.given_up or c.proc.poll() is None:
                if c.restarting and c.proc.poll() is None and os.path.exists(c.ready_file):
                    c.restarting = False
                    c.read_ready()
                    print(f"pddjax up: the {c.role} service {c.address} is serving again", file=sys.stderr, flush=True)
                continue
            if key not in self.due:  # a new exit
                times = self.exits[key]
                times.append(now)
                while times and now - times[0] > WINDOW_S:
                    times.popleft()
                if len(times) > MAX_RESTARTS:
                    self.given_up.add(key)
                    print(f"pddjax up: the {c.role} service {c.address} exited {len(times)} times in "
                          f"{WINDOW_S:.0f} s ({c.proc.returncode}); not restarting it", file=sys.stderr, flush=True)
                    continue
                wait = min(MAX_BACKOFF_S, RESTART_BACKOFF_S * 2 ** (len(times) - 1))
                self.due[key] = now + wait
                print(f"pddjax up: the {c.role} service {c.address} exited ({c.proc.returncode}); restarting it "
                      f"in {wait:.0f} s", file=sys.stderr, flush=True)
            elif now >= self.due[key]:
                del self.due[key]
                self.restarts += 1
                try:
                    c.relaunch()
                except (OSError, subprocess.SubprocessError) as e:
                    self.given_up.add(key)
                    print(f"pddjax up: cannot restart the {c.role} service: {e}", file=sys.stderr, flush=True)
        roles = {c.role for c in self.children}
        return sorted(r for r in roles if all(id(c) in self.given_up for c in self.children if c.role == r))
