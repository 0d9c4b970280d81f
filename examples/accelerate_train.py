"""A training loop of your own under `accelerate launch` with DeepSpeed ZeRO (accelerate_deepspeed.yaml).

    accelerate launch --config_file accelerate_deepspeed.yaml accelerate_train.py MODEL OUTPUT_DIR
"""
import sys

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

model_path, output_dir = sys.argv[1:3]
steps = 4

# The Accelerator first: under ZeRO-3 from_pretrained then loads each rank's shard only.
accelerator = Accelerator(mixed_precision="bf16")
model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

# Stand-in data: replace with your tokenized dataset.
tokens = torch.randint(model.config.vocab_size, (32, 12), generator=torch.Generator().manual_seed(0))
loader = DataLoader(tokens, batch_size=2)

model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
for step, batch in zip(range(1, steps + 1), loader):
    loss = model(input_ids=batch, labels=batch).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    mean_loss = accelerator.reduce(loss.detach(), "mean")
    accelerator.print(f"step {step}: loss {mean_loss.item()!r}")

accelerator.save_state(f"{output_dir}/checkpoint")  # the ZeRO checkpoint (optimizer included)
accelerator.unwrap_model(model).save_pretrained(output_dir, state_dict=accelerator.get_state_dict(model),
                                                is_main_process=accelerator.is_main_process,
                                                save_function=accelerator.save)
# Wait for every rank before exit: gloo's worker thread may still be freeing the last collective's tensors,
# which needs the GIL, and an interpreter shutting down under it aborts the process. The wait makes that rare.
accelerator.wait_for_everyone()
accelerator.end_training()
