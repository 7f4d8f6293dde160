"""The symmetric-memory all-reduce path (afd_compile/symm_mem.py): which messages take it (a
table), how a group where it cannot run is turned off (CPU / gloo here: the path itself needs
GPUs that reach each other, exercised by benchmarks/junction.py in gpu_suite.sh), and the
lowering that lets Inductor fuse each junction's add + RMSNorm."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist

from afd_compile import ops as _ops  # noqa: F401  (registers torch.ops.afd)
from afd_compile import symm_mem
from afd_compile.symm_mem import DEFAULT_MAX_BYTES, junction_path, max_bytes_from_env

MB = 1 << 20


@pytest.mark.parametrize(("nbytes", "dtype", "ready", "max_bytes", "path"), [
    (64 * 1024, torch.bfloat16, True, 2 * MB, "symm"),      # decode: T=8 x 4096 bf16
    (2 * MB, torch.bfloat16, True, 2 * MB, "symm"),         # the limit is inclusive
    (2 * MB + 16, torch.bfloat16, True, 2 * MB, "nccl"),    # above the limit
    (64 * 1024, torch.float32, True, 2 * MB, "symm"),
    (64 * 1024, torch.float16, True, 2 * MB, "nccl"),       # a dtype the one-shot kernel does not reduce
    (64 * 1024, torch.int64, True, 2 * MB, "nccl"),
    (64 * 1024, torch.bfloat16, False, 2 * MB, "nccl"),     # the group is off
    (6, torch.bfloat16, True, 2 * MB, "nccl"),              # 3 bf16: not 4-byte aligned
    (0, torch.bfloat16, True, 2 * MB, "nccl"),              # nothing to reduce
    (64 * 1024, torch.bfloat16, True, 0, "nccl"),
])
def test_junction_path(nbytes, dtype, ready, max_bytes, path):
    assert junction_path(nbytes, dtype, ready, max_bytes) == path


def test_max_bytes_from_the_environment(monkeypatch):
    monkeypatch.delenv("AFD_SYMM_MEM_MAX_BYTES", raising=False)
    assert max_bytes_from_env() == DEFAULT_MAX_BYTES
    monkeypatch.setenv("AFD_SYMM_MEM_MAX_BYTES", "65536")
    assert max_bytes_from_env() == 65536
    for bad in ("64k", "-1"):
        monkeypatch.setenv("AFD_SYMM_MEM_MAX_BYTES", bad)
        with pytest.raises(ValueError, match="AFD_SYMM_MEM_MAX_BYTES"):
            max_bytes_from_env()


@pytest.fixture
def gloo_world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.new_group([0])
    finally:
        symm_mem.release()
        dist.destroy_process_group()


def test_a_cpu_group_is_off_with_its_reason_and_all_reduce_takes_gloo(gloo_world_of_one, caplog):
    from afd_compile.comm import register_group

    register_group(7, gloo_world_of_one)
    with caplog.at_level(logging.INFO, logger="afd_compile.symm_mem"):
        symm_mem.prepare_groups({7: gloo_world_of_one, 8: gloo_world_of_one}, torch.device("cpu"))
    state = symm_mem.state_of(7)
    assert state is not None and not state.ready and symm_mem.state_of(8) is state
    assert str(state) == "symmetric memory off (tensors on cpu, not CUDA): the group's own all-reduce"
    # logged once for the group, though registered under two ids
    assert [r.getMessage() for r in caplog.records] == [f"afd: group 7 (1 ranks): {state}"]
    x = torch.randn(4, 8)
    assert symm_mem.try_all_reduce(x, 7) is None
    assert torch.equal(torch.ops.afd.all_reduce(x, 7), x)  # a group of one: the sum is x
    symm_mem.prepare(7, gloo_world_of_one, torch.device("cpu"), enabled=False)
    assert symm_mem.state_of(7).why_off == "symm_mem=False"


def test_the_backend_option_is_checked():
    from afd_compile.backend import BackendOptionError, BackendOptions

    assert BackendOptions.parse({"tp": 2}).symm_mem is True
    assert BackendOptions.parse({"tp": 2, "symm_mem": False}).symm_mem is False
    with pytest.raises(BackendOptionError, match=r"option symm_mem='no' \(str\) must be a bool"):
        BackendOptions.parse({"tp": 2, "symm_mem": "no"})
