"""A Hugging Face ``Trainer`` script as a user writes one: a small GPT-2 configuration built in code, random
token data, ``deepspeed=`` a Muon config with ``"auto"`` entries, for ``python -m harness watch`` to run
unchanged under ``torchrun``.

    torchrun --nproc_per_node 2 cases/cli/watch_hf.py --ds-config examples/hf_zero2_muon.json [--patched]
                                                      [--steps 3] [--out DIR]

``--patched`` applies the bundled fixes first, as the patched runtime's own instructions say.
"""
from __future__ import annotations

import argparse
import json
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

VOCAB, CONTEXT = 64, 16


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, CONTEXT), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ds-config", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--patched", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()
    if args.patched:
        from harness.fixes import apply

        apply()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=32, n_layer=2, n_head=2))
    with open(args.ds_config) as f:
        ds = json.load(f)
    training = TrainingArguments(
        output_dir=args.out or tempfile.mkdtemp(prefix="watch-hf-"), per_device_train_batch_size=2,
        gradient_accumulation_steps=2, max_steps=args.steps, learning_rate=0.02, weight_decay=0.01,
        warmup_steps=1, logging_steps=1, save_strategy="no", report_to=[], deepspeed=ds, seed=0,
        dataloader_num_workers=0, disable_tqdm=True)
    Trainer(model=model, args=training, train_dataset=RandomTokens(64, seed=1)).train()
    # the Trainer leaves the process group to the interpreter's exit, where gloo's threads can abort the
    # process after a finished run; a script that ends its group ends cleanly
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
