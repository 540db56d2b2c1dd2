"""PyTorch (with CUDA) as the frameworks tests run it: `make test-frameworks` installs it into a
venv of its own (.venv-frameworks, `pip install torch==2.14.1`); the tests drive it in child
processes with that venv's Python.  The same child scripts run against the simulated GPU
(tests/frameworks) and a real one (tests/gpu).
"""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-frameworks"
TORCH_VERSION = "2.14.1"


@functools.cache
def torch_python() -> str | None:
    """The frameworks venv's Python if it imports torch, else None."""
    py = os.environ.get("VGPU_FRAMEWORKS_PYTHON") or str(VENV / "bin" / "python")
    if not os.path.exists(py):
        return None
    p = subprocess.run([py, "-c", "import torch"], capture_output=True, timeout=300)
    return py if p.returncode == 0 else None


# Fills the GPU with torch tensors until torch.cuda.OutOfMemoryError (the allocator chosen by
# PYTORCH_CUDA_ALLOC_CONF), then halves the request down to 2 MiB taking what still fits; prints
# one `fill ...` line (the counts and torch's own statistics) and `holding`, then waits for stdin
# to close.  argv: CHUNK_BYTES.
TORCH_FILL = r"""
import os, sys, torch
chunk = int(sys.argv[1])
held, ooms, big = [], 0, 0
try:
    while True:
        held.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
        big += 1
except torch.cuda.OutOfMemoryError:
    ooms += 1
size = chunk // 2
while size >= 2 << 20:
    try:
        held.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
    except torch.cuda.OutOfMemoryError:
        ooms += 1
        size //= 2
torch.cuda.synchronize()
free, total = torch.cuda.mem_get_info()
try:  # the cudaMallocAsync backend reads cudaDeviceGetGraphMemAttribute for its statistics
    st = torch.cuda.memory_stats()
    reserved, allocated = torch.cuda.memory_reserved(), torch.cuda.memory_allocated()
except RuntimeError as e:
    st, reserved, allocated = {}, -1, -1
    print("stats-error " + str(e).splitlines()[0].replace(" ", "_"), flush=True)
print(f"fill big={big} tensors={len(held)} ooms={ooms} bytes={sum(t.numel() for t in held)} "
      f"reserved={reserved} allocated={allocated} "
      f"stat_reserved={st.get('reserved_bytes.all.current', -1)} free={free} total={total} "
      f"conf={os.environ.get('PYTORCH_CUDA_ALLOC_CONF', 'default')}", flush=True)
print("holding", flush=True)
sys.stdin.read()
"""

# CUDA-graph capture (torch.cuda.graph): a captured graph that allocates, replayed; then a capture
# whose allocations do not fit in what is left must fail with OutOfMemoryError.  argv: CHUNK_BYTES.
TORCH_GRAPH = r"""
import sys, torch
chunk = int(sys.argv[1])
static_in = torch.zeros(1 << 20, device="cuda")
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    out = static_in * 2
torch.cuda.current_stream().wait_stream(s)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    tmp = torch.empty(chunk, dtype=torch.uint8, device="cuda")
    out = static_in * 3
g.replay()
torch.cuda.synchronize()
print(f"graph replayed=1 reserved={torch.cuda.memory_reserved()}", flush=True)
held, err = [], "none"
try:
    while True:
        g2 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g2):
            t = torch.empty(chunk, dtype=torch.uint8, device="cuda")
        held.append((g2, t))
except torch.cuda.OutOfMemoryError:
    err = "OutOfMemoryError"
except RuntimeError as e:
    err = "RuntimeError:" + str(e).splitlines()[0].replace(" ", "_")
torch.cuda.synchronize()
print(f"graphs count={len(held)} err={err} reserved={torch.cuda.memory_reserved()}", flush=True)
print("holding", flush=True)
sys.stdin.read()
"""
