"""The CPU profile's kernel stand-in, run where it runs: SGLang's own environment (its torch). It must do what
sgl_kernel's ``assign_req_to_token_pool_cpu`` and the triton kernel beside it (``assign_req_to_token_pool``,
``srt/mem_cache/allocation.py``) do: request i's slots ``[start_i, end_i)`` of its pool row take the next
``end_i - start_i`` entries of ``out_cache_loc``, in order. Checked against a loop written from that text, on random
batches (the serving tier only shows that answers come back, not that every slot is right)."""

from __future__ import annotations

import subprocess

import pytest

from engine.sglang import plan
from tests.procs import ROOT
from tests.real.engines import require_installed

pytestmark = pytest.mark.timeout(180)
SCRIPT = r"""
import random, torch
from engine.sglang.cpu import assign_req_to_token_pool_cpu
rng = random.Random(7)
for case in range(200):
    pools, pool_len = 16, 64
    bs = rng.randint(1, 8)
    rows = rng.sample(range(pools), bs)
    starts = [rng.randint(0, pool_len - 1) for _ in rows]
    ends = [rng.randint(s, pool_len) for s in starts]
    total = sum(e - s for s, e in zip(starts, ends))
    out = torch.randint(0, 10_000, (total,), dtype=torch.int64)
    got = torch.full((pools, pool_len), -1, dtype=torch.int32)
    want = got.clone()
    assign_req_to_token_pool_cpu(torch.tensor(rows), got, torch.tensor(starts), torch.tensor(ends), out, pool_len)
    at = 0
    for r, s, e in zip(rows, starts, ends):
        for j in range(s, e):
            want[r, j] = int(out[at]); at += 1
    assert torch.equal(got, want), (case, rows, starts, ends)
print("200 batches ok")
"""


def test_the_kernel_stand_in_fills_the_slots_as_sglangs_kernel_does() -> None:
    require_installed("sglang")
    exe = plan.python(plan.load_profile("cpu"))
    out = subprocess.run([exe, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "200 batches ok" in out.stdout, out.stderr[-2000:]
