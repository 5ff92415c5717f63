"""The weights cache under processes that start at once, as `pddjax up` starts its services:
readers polling while one writer writes (slowly) see no cache or the whole one, never a part,
and drop nothing; two loaders of one model on an empty cache both get the right weights and
leave one intact cache and no temp dirs behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np

from pddjax.model import checkpoint_cache as cc
from pddjax.model import weights as wmod
from pddjax.model.registry import load_model
from tests.support.gguf_factory import write_llama_gguf

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
READERS = 3

PRELUDE = """
import json, logging, os, sys, time
import numpy as np
from pddjax.model import checkpoint_cache as cc
from pddjax.model import weights as wmod
from pddjax.model.config import TINY
warnings = []
class Keep(logging.Handler):
    def emit(self, record):
        warnings.append(record.getMessage())
logging.getLogger(cc.__name__).addHandler(Keep())
want = wmod.to_dict(wmod.init_random(TINY, 0))
run = sys.argv[1]
def wait_for(pred, what):
    deadline = time.monotonic() + 120
    while not pred():
        if time.monotonic() > deadline:
            sys.exit(f"timed out waiting for {what}")
        time.sleep(0.005)
"""

READER = PRELUDE + """
open(os.path.join(run, f"ready-{os.getpid()}"), "w").close()
nones, got = 0, None
def poll():
    global nones, got
    got = cc.restore("fp")
    nones += got is None
    return got is not None
wait_for(poll, "the cache")
d = wmod.to_dict(got[0])
same = d.keys() == want.keys() and all(np.array_equal(d[k], want[k]) for k in want)
print(json.dumps({"same": bool(same), "nones": nones, "warnings": warnings}))
"""

WRITER = PRELUDE + """
wait_for(lambda: len([f for f in os.listdir(run) if f.startswith("ready-")]) == int(sys.argv[2]), "the readers")
real = cc._write_tensor
def slow(path, arr):
    time.sleep(0.05)  # a long write: the readers poll all through it
    return real(path, arr)
cc._write_tensor = slow
cc.save("fp", wmod.from_dict(want), {"config": {}})
print(json.dumps({"warnings": warnings}))
"""

LOADER = """
import json, os, sys, time
import numpy as np
from pddjax.model.registry import load_model
from pddjax.model import weights as wmod
go = os.path.join(sys.argv[1], "go")
while not os.path.exists(go):
    time.sleep(0.005)
m = load_model(sys.argv[2])
d = wmod.to_dict(m.weights)
print(json.dumps({"source": m.source, "fingerprint": m.fingerprint,
                  "sums": {k: float(np.asarray(v, np.float64).sum()) for k, v in d.items()}}))
"""


def start(code: str, *args: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result(p: subprocess.Popen) -> dict:
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1])


def test_readers_never_see_a_half_written_cache(tmp_path):
    env = {**os.environ, "PDDJAX_CACHE_DIR": str(tmp_path / "cache"), "JAX_PLATFORMS": "cpu"}
    run = str(tmp_path)
    readers = [start(READER, run, env=env) for _ in range(READERS)]
    writer = start(WRITER, run, str(READERS), env=env)
    got = [result(p) for p in readers]
    assert result(writer) == {"warnings": []}
    assert all(r["same"] and r["warnings"] == [] for r in got), got
    assert all(r["nones"] > 1 for r in got)  # each polled while the writer wrote
    assert os.listdir(tmp_path / "cache" / "weights") == ["fp"]


def test_two_loaders_at_once_share_one_intact_cache(tmp_path, monkeypatch, tiny):
    env = {**os.environ, "PDDJAX_CACHE_DIR": str(tmp_path / "cache"), "JAX_PLATFORMS": "cpu"}
    path = str(tmp_path / "t.gguf")
    write_llama_gguf(path, tiny.config, tiny.weights, {"q": "Q8_0"})
    loaders = [start(LOADER, str(tmp_path), path, env=env) for _ in range(2)]
    (tmp_path / "go").touch()
    got = [result(p) for p in loaders]
    monkeypatch.setenv("PDDJAX_CACHE_DIR", str(tmp_path / "cache"))
    direct = load_model(path, use_cache=False)
    assert os.listdir(tmp_path / "cache" / "weights") == [direct.fingerprint]  # no temp dir left
    cc.check_integrity(direct.fingerprint)
    assert load_model(path).source == "weights-cache"
    sums = {k: float(np.asarray(v, np.float64).sum()) for k, v in wmod.to_dict(direct.weights).items()}
    assert all(r["fingerprint"] == direct.fingerprint and r["sums"] == sums for r in got)
    assert {r["source"] for r in got} <= {"gguf", "weights-cache"}
