"""Host-side init speed on the GPU box: allocate 2 GiB of bf16 (pageable, pinned, pre-faulted) or 4 GiB of
fp32 in host memory and time nn.init.normal_ / uniform_ on it. Why zero.Init under the key is slow for
parameters created in host memory: their random init runs on the CPU.

``python bench/probes/probe_host_init.py`` (prints one line per mode; figures in bench/results/host_init_h200_box.json)."""
import torch, time
print("threads", torch.get_num_threads(), flush=True)
n = 1 << 30  # 2 GiB of bf16
for mode in ["pageable", "pinned", "prefault", "fp32"]:
    t0 = time.perf_counter()
    if mode == "pinned":
        t = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
    elif mode == "fp32":
        t = torch.empty(n, dtype=torch.float32)
    else:
        t = torch.empty(n, dtype=torch.bfloat16)
    t1 = time.perf_counter()
    if mode == "prefault":
        t.zero_()
    t2 = time.perf_counter()
    torch.nn.init.normal_(t)
    t3 = time.perf_counter()
    torch.nn.init.uniform_(t)
    t4 = time.perf_counter()
    print(f"{mode:9s} alloc {t1-t0:.2f}s prefault {t2-t1:.2f}s normal_ {t3-t2:.2f}s uniform_ {t4-t3:.2f}s", flush=True)
    del t
