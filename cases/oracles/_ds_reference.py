"""Run DeepSpeed 0.19.8's own code on inputs prepared by a test; save what it computes.

Used by ``test_oracle_vs_deepspeed.py`` as ``python _ds_reference.py IN.pt OUT.pt`` in a subprocess,
so that DeepSpeed is imported with ``DS_ACCELERATOR=cpu`` and ``TORCHDYNAMO_DISABLE=1`` set before the
import (eager ``muon_update``: the only mode a bit-faithful emulation can match) and without touching
the test process. Nothing from ``oracles`` is used here: the outputs are DeepSpeed's alone.
"""
import os
import sys

os.environ["DS_ACCELERATOR"] = "cpu"
os.environ["TORCHDYNAMO_DISABLE"] = "1"

import torch  # noqa: E402


def main(inp: str, out: str) -> None:
    torch.set_num_threads(int(os.environ.get("ORACLE_TEST_THREADS", "1")))
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    from harness.env import device

    device.install_cpu_fp16_standin()  # the device the ranks see (harness.env.device)
    from deepspeed.runtime.zero.muon import original_muon as om
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from deepspeed.runtime.fp16 import loss_scaler as ls
    from deepspeed.runtime.zero.partition_parameters import Init

    spec = torch.load(inp)
    res = {"ns_dtypes": (om.ns_compute_dtype("gram"), om.ns_compute_dtype("standard"))}

    # 1. eager muon_update as shipped (16-bit NS); inputs are not modified (we pass clones)
    upd = []
    for c in spec["muon_cases"]:
        g, m = c["grad"].clone(), c["momentum"].clone()
        o = om.muon_update(g, m, beta=c["beta"], ns_method=c["ns_method"], is_expert_group=c["expert"],
                           num_heads=c["num_heads"])
        upd.append({"direction": o, "momentum": m})
    res["muon"] = upd

    # 2. "hpns": Newton-Schulz forced to float64 by patching the dtype selector
    saved = om.ns_compute_dtype
    om.ns_compute_dtype = lambda ns_method="gram": torch.float64
    try:
        hp = []
        for c in spec["hpns_cases"]:
            g, m = c["grad"].clone(), c["momentum"].clone()
            o = om.muon_update(g, m, beta=c["beta"], ns_method=c["ns_method"], num_heads=c["num_heads"])
            hp.append({"direction": o, "momentum": m})
        res["hpns"] = hp
    finally:
        om.ns_compute_dtype = saved

    # 3. ZeRO-1/2 partition bookkeeping (get_partition_info does not use self)
    part = []
    for c in spec["partition_cases"]:
        metas = [torch.empty(n, device="meta") for n in c["numels"]]
        pin, pout, first = DeepSpeedZeroOptimizer.get_partition_info(None, metas, c["partition_size"], c["rank"],
                                                                     c["param_padding"])
        ids = {id(t): i for i, t in enumerate(metas)}
        part.append({"in": [ids[id(t)] for t in pin], "first_offset": first})
    res["partition"] = part

    # 4. ZeRO-3 per-parameter padding
    class _FakeInit:
        def __init__(self, w):
            self.w = w

        def _partition_world_size(self, param):
            return self.w

    class _P:
        def __init__(self, n):
            self.ds_numel = n

    res["z3_padding"] = [Init._padding_size(_FakeInit(w), _P(n)) for n, w in spec["z3_cases"]]

    # 5. the dynamic loss scaler itself
    ls.dist.get_rank = lambda *a, **k: 0
    seqs = []
    for c in spec["scaler_cases"]:
        s = ls.DynamicLossScaler(init_scale=c["init_scale"], scale_window=c["window"], min_scale=c["min_scale"],
                                 delayed_shift=c["hysteresis"], consecutive_hysteresis=c["consecutive"],
                                 raise_error_at_min_scale=False)
        trace = []
        for ovf in c["overflows"]:
            s.update_scale(ovf)
            trace.append((s.cur_scale, s.cur_iter, s.last_overflow_iter, s.cur_hysteresis))
        seqs.append(trace)
    res["scaler"] = seqs
    torch.save(res, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
