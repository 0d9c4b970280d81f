"""Fine-tune a causal LM with the HF Trainer under DeepSpeed ZeRO; ztriton acts through the config's key.

    deepspeed --num_gpus 8 trainer_deepspeed.py MODEL OUTPUT_DIR --deepspeed ds_zero3.json
    torchrun --nproc_per_node 8 trainer_deepspeed.py MODEL OUTPUT_DIR --deepspeed ds_zero2.json
    ... --resume OUTPUT_DIR/checkpoint-2       (continue from a checkpoint this script saved)
"""
import argparse

import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

parser = argparse.ArgumentParser()
parser.add_argument("model")
parser.add_argument("output_dir")
parser.add_argument("--deepspeed", default="ds_zero3.json")  # a config with "partition_backend": "triton"
parser.add_argument("--resume", default=None)
parser.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher passes it
cli = parser.parse_args()

# bf16 on GPUs; on the CPU the Trainer takes bf16 only without DeepSpeed, so there it trains in fp32.
bf16 = torch.cuda.is_available()
# TrainingArguments first: with a ZeRO-3 config it makes from_pretrained load each rank's shard only.
# (A four-step demo: set your own steps, batch size and learning rate.)
args = TrainingArguments(output_dir=cli.output_dir, deepspeed=cli.deepspeed, bf16=bf16, per_device_train_batch_size=2,
                         max_steps=4, learning_rate=1e-3, logging_steps=1, save_steps=2, report_to="none")
model = AutoModelForCausalLM.from_pretrained(cli.model, dtype=torch.bfloat16 if bf16 else torch.float32)

# Stand-in data: replace with your tokenized dataset.
tokens = torch.randint(model.config.vocab_size, (32, 12), generator=torch.Generator().manual_seed(0))
dataset = [{"input_ids": row, "labels": row} for row in tokens]

trainer = Trainer(model=model, args=args, train_dataset=dataset)
trainer.train(resume_from_checkpoint=cli.resume)
trainer.save_model()

# Wait for every rank before exit: gloo's worker thread may still be freeing the last collective's tensors,
# which needs the GIL, and an interpreter shutting down under it aborts the process. The wait makes that rare.
if torch.distributed.is_initialized():
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
