"""NVML device matching: with CUDA_VISIBLE_DEVICES reordering the GPUs, the runtime's NVML handle
must be the physical GPU that torch uses (matched by UUID, never by index).

    CUDA_VISIBLE_DEVICES=1,0 python benchmarks/nvml_check.py
"""

from __future__ import annotations

import json
import os

import pynvml
import torch

from autobalance.runtime import NvmlDevice


def main() -> None:
    pynvml.nvmlInit()
    rows = []
    for i in range(torch.cuda.device_count()):
        dev = NvmlDevice(i)
        torch.cuda.set_device(i)
        before = dev.used_bytes()
        x = torch.empty(4 * 2**30, dtype=torch.uint8, device=f"cuda:{i}")  # 4 GiB on torch device i
        torch.cuda.synchronize(i)
        grew = dev.used_bytes() - before
        by_index = pynvml.nvmlDeviceGetHandleByIndex(i)
        rows.append({
            "torch_index": i, "torch_uuid": str(torch.cuda.get_device_properties(i).uuid), "nvml_uuid": dev.uuid,
            "grew_gib_on_uuid_match": grew / 2**30,
            "nvml_index_i_uuid": pynvml.nvmlDeviceGetUUID(by_index),
        })
        del x
        torch.cuda.empty_cache()
    ok = all(r["grew_gib_on_uuid_match"] > 3.9 for r in rows)
    print(json.dumps({"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"), "ok": ok, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
