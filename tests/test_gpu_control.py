"""The AFD control messages of an NCCL deployment (issue 35), on one GPU: two processes join an
NCCL world, make the gloo group beside it that control messages travel on
(``runtime.control_group``), and an attention rank's per-step messages reach its FFN rank's
worker without a device-to-host read (``device_reads`` stays 0, ``control_reads`` counts them).
Nothing here runs an NCCL operation (two ranks on one GPU cannot form an NCCL communicator), so
it checks the control path, not the exchange. Marked ``gpu`` (CI has no GPU);
``benchmarks/gpu_suite.sh one`` runs it."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def _rank(rank: int, port: int, out: dict) -> None:
    from afd_compile.comm import AFDCommunicator
    from afd_compile.runtime import STOP, FFNWorker, control_group, group_key, send_control

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
    key = group_key(None)
    control = control_group(*key)
    if rank == 1:
        comm = AFDCommunicator("attention", 1, (0,), control_group=control)
        for n in (3, 8, 0):
            send_control(comm, n)
        send_control(comm, STOP)
        out[rank] = {"device": comm.control_device, "transport": comm.device_transport}
    else:
        comm = AFDCommunicator("ffn", 0, (1,), control_group=control)
        seen: list = []
        worker = FFNWorker(lambda *carriers: seen.append([tuple(c.shape) for c in carriers]), comm,
                           torch.device("cuda", 0))
        steps = worker.serve()
        bare = AFDCommunicator("ffn", 0, (1,))  # (no control group: its messages would wait on the device)
        out[rank] = {"steps": steps, "seen": seen, "control_reads": worker.control_reads,
                     "device_reads": worker.device_reads, "device": comm.control_device,
                     "bare_device": bare.control_device, "key": key, "backend": dist.get_backend(control)}
    dist.destroy_process_group()


def test_control_messages_of_an_nccl_world_travel_host_to_host() -> None:
    from afd_compile.runtime import free_port

    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(free_port(), out), nprocs=2, join=True)
        res = dict(out)
    assert res[1] == {"device": "cpu", "transport": True}, res
    ffn = res[0]
    assert ffn["steps"] == 3 and ffn["seen"] == [[(3, 0)], [(8, 0)]], ffn  # (a step of 0 tokens runs nothing)
    assert ffn["control_reads"] == 4 and ffn["device_reads"] == 0, ffn
    assert (ffn["device"], ffn["bare_device"], ffn["backend"]) == ("cpu", "cuda", "gloo"), ffn
    assert ffn["key"] == ((0, 1), 60.0), ffn
