"""A plain DeepSpeed ZeRO-3 script around a transformers model: each rank loads only its shard of the checkpoint.

    torchrun --nproc_per_node 8 deepspeed_from_pretrained.py MODEL OUTPUT_DIR
    deepspeed --num_gpus 8 deepspeed_from_pretrained.py MODEL OUTPUT_DIR
    PARTITION_BACKEND=torch ...        (DeepSpeed's own code, to compare)
"""
import argparse
import os

import deepspeed
import torch
from transformers import AutoModelForCausalLM
from transformers.integrations import HfDeepSpeedConfig

parser = argparse.ArgumentParser()
parser.add_argument("model")
parser.add_argument("output_dir")
parser.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher passes it
cli = parser.parse_args()

ds_config = {
    "train_micro_batch_size_per_gpu": 2,
    "zero_optimization": {"stage": 3},
    "bf16": {"enabled": True},
    "partition_backend": os.environ.get("PARTITION_BACKEND", "triton"),
}
deepspeed.init_distributed()
dschf = HfDeepSpeedConfig(ds_config)  # before from_pretrained, and kept alive: transformers reads it
model = AutoModelForCausalLM.from_pretrained(cli.model, dtype=torch.bfloat16)
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                  config=ds_config)

# Stand-in data (steps x ranks x batch x sequence): replace with your tokenized dataset.
steps, rank, world = 4, engine.global_rank, engine.world_size
tokens = torch.randint(model.config.vocab_size, (steps, world, 2, 12), generator=torch.Generator().manual_seed(0))
for step in range(steps):
    batch = tokens[step, rank].to(engine.device)
    loss = engine(input_ids=batch, labels=batch).loss
    engine.backward(loss)
    engine.step()
    if rank == 0:
        print(f"step {step + 1}: loss {loss.item()!r}")
engine.save_checkpoint(cli.output_dir)  # the ZeRO checkpoint; zero_to_fp32 makes a plain state dict of it

# Wait for every rank before exit: gloo's worker thread may still be freeing the last collective's tensors,
# which needs the GIL, and an interpreter shutting down under it aborts the process. The wait makes that rare.
deepspeed.comm.barrier()
deepspeed.comm.destroy_process_group()
