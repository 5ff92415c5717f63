"""The unprivileged user `pddjax up --netns`'s services run as (serving/stack/netns_up.py).

Making the namespaces, veths and qdiscs needs root; the services do not. Each service (and the
userspace WAN link) is started behind `ip netns exec NS` and then `setpriv`, which drops it to
SERVICE_USER (nobody): its own user and group, no supplementary groups, no capabilities (none
inherited, none in the bounding set) and no new privileges, before Python starts. So that it
can still work:
- its HOME is HOME_DIR (made by root under /var/cache, owned by the user, mode 0700) and its
  cache (PDDJAX_CACHE_DIR: converted weights, content hashes, the JIT cache) lives there, kept
  across runs, unless PDDJAX_CACHE_DIR / PDDJAX_JIT_CACHE_DIR are set (then they must be the
  user's to write);
- the run's folder (ready files) is handed to the user;
- a TLS directory and the router's token file are copied into that folder, readable by the user
  only, and the services read the copies (the state file still names the original TLS directory:
  clients need its ca.pem only).
A model named by a path must be readable by the user. Before any service starts, the user must
be able to run this Python and import pddjax (a probe, PROBE_SECONDS at most): an interpreter or
a checkout in a folder it cannot read (say under /root) is a UserError naming the path and the
way out. `--netns-user root` keeps the services root (one warning line): ROOT, no prefix.
No such user: UserError, one sentence.
"""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass

from pddjax import env
from pddjax.errors import UserError

SERVICE_USER = "nobody"
HOME_DIR = "/var/cache/pddjax-netns"
PROBE_SECONDS = 120.0


@dataclass(frozen=True)
class ServiceUser:
    uid: int
    gid: int
    env: dict[str, str]  # added to each service's environment

    def prefix(self) -> list[str]:
        """The command prefix that runs the rest of a command line as this user (after `ip netns exec NS`)."""
        if self.uid == 0:
            return []
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups", "--inh-caps=-all",
                "--bounding-set=-all", "--no-new-privs", "env", *(f"{k}={v}" for k, v in self.env.items())]


def _own(path: str, uid: int, gid: int, mode: int) -> None:
    """`path` (a real folder, no link) made the user's, with `mode`."""
    if stat.S_ISLNK(os.lstat(path).st_mode) or not os.path.isdir(path):
        raise UserError(f"{path} must be a folder (not a link) for the services of `up --netns`")
    os.chown(path, uid, gid)
    os.chmod(path, mode)


ROOT = ServiceUser(0, 0, {})


def probe(user: ServiceUser, python: str = sys.executable) -> str | None:
    """None when `user` can run `python` and import pddjax and serving, else why (one line)."""
    try:
        run = subprocess.run([*user.prefix(), python, "-c", "import pddjax, serving"], capture_output=True,
                             text=True, timeout=PROBE_SECONDS, cwd="/")
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{type(e).__name__}: {e}"
    if run.returncode == 0:
        return None
    lines = (run.stderr or run.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit code {run.returncode}"


TLS_COPY, TOKEN_COPY = "tls", "router-token"  # the services' copies of the user's secrets, in the run's folder
SECRET_COPIES = (TLS_COPY, TOKEN_COPY)


def prepare(workdir: str, user: str = SERVICE_USER, home: str = HOME_DIR, python: str = sys.executable) -> ServiceUser:
    """The services' user, with `workdir` (the run's folder), its HOME and a TLS copy made ready for it.
    `user` root: ROOT (the caller warns)."""
    if user == "root":
        return ROOT
    if shutil.which("setpriv") is None:
        raise UserError("`pddjax up --netns` needs util-linux's `setpriv` to run its services unprivileged")
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        raise UserError(f"`pddjax up --netns` runs its services as the user {user!r}, which does not exist") from None
    uid, gid = pw.pw_uid, pw.pw_gid
    if uid == 0:
        raise UserError(f"the services' user {user!r} is root; `pddjax up --netns` needs an unprivileged one")
    why = probe(ServiceUser(uid, gid, {"HOME": "/"}), python)
    if why:
        raise UserError(f"the services' user {user!r} cannot run this Python ({python}) with pddjax: {why}; "
                        f"install pddjax where {user!r} can read it (a virtual environment outside /root), "
                        f"or pass --netns-user root to run the services as root")
    os.makedirs(home, exist_ok=True)
    _own(home, uid, gid, 0o700)
    _own(workdir, uid, gid, 0o700)
    extra = {"HOME": home}
    if env.CACHE_DIR.get() is None:
        extra[env.CACHE_DIR.name] = os.path.join(home, "cache")
    tls = env.TLS_DIR.get()
    if tls:
        copy = os.path.join(workdir, TLS_COPY)
        shutil.copytree(tls, copy, symlinks=False)
        for dirpath, _, files in os.walk(copy):
            _own(dirpath, uid, gid, 0o700)
            for f in files:
                os.chown(os.path.join(dirpath, f), uid, gid)
                os.chmod(os.path.join(dirpath, f), 0o600)
        extra[env.TLS_DIR.name] = copy
    token = env.ROUTER_TOKEN_FILE.get()
    if token:
        copy = os.path.join(workdir, TOKEN_COPY)
        shutil.copyfile(token, copy)
        os.chown(copy, uid, gid)
        os.chmod(copy, 0o600)
        extra[env.ROUTER_TOKEN_FILE.name] = copy
    return ServiceUser(uid, gid, extra)
