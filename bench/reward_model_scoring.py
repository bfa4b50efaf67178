"""A reward model's scoring against one plain forward of the same model: what scoring a batch of episodes costs
beyond the forward pass itself (issue 40's benchmark).

    python bench/reward_model_scoring.py [--sequences 128] [--min-len 32] [--max-len 160] [--repeats 5] [--smoke]

A random Qwen3 sequence classifier (transformers writes it: SHAPE, vocabulary VOCAB, pad token 0) is loaded by the
reward model's workers (one, in this process, fp32, ``reward_model.micro_batch_size`` rows per pass) and scores
``--sequences`` sequences of lengths drawn between the two bounds: ``RewardModelGroup.scores`` on
``score_batch``'s rows (what a run does for every step's episodes: the batch built, the model woken, its passes
through Megatron's schedule, each row's score read at its position, the model put back to sleep). The floor is the
same Megatron model's forward on the same padded batch, micro-batch by micro-batch, with nothing around it. Prints
the median seconds of each over ``--repeats`` after a warm-up, and the ratio. Last line:
``reward model scoring / plain forward <x>x (<n> sequences, <t> tokens)``. ``--smoke``
(tests/integration/test_bench_smoke.py): SMOKE_SHAPE, 8 sequences, one repeat.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

SHAPE = dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64, ffn_hidden_size=768)
SMOKE_SHAPE = dict(SHAPE, hidden_size=64, num_layers=2, head_dim=16, ffn_hidden_size=128)
VOCAB = 4096
MICRO_BATCH = 32


def write_classifier(path: str, shape: dict, max_len: int) -> None:
    """A random one-label Qwen3ForSequenceClassification with pad token 0, as transformers saves it."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from rlcore_model_qwen3.plugin import QWEN3

    hf = {**QWEN3.tiny_hf_config(vocab_size=VOCAB, max_position_embeddings=max_len + 8, **shape),
          "architectures": ["Qwen3ForSequenceClassification"], "id2label": {"0": "LABEL_0"},
          "label2id": {"LABEL_0": 0}, "pad_token_id": 0}
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(AutoConfig.for_model(**hf)).float().save_pretrained(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=128)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.sequences, args.max_len, args.repeats = 8, 48, 1
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from rlcore.config import load_config
    from rlcore.megatron.reward_model import score_batch
    from rlcore.workers.proxies import RewardModelGroup

    torch.set_num_threads(1)
    rng = random.Random(0)
    sequences = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(args.min_len, args.max_len))]
                 for _ in range(args.sequences)]
    tokens = sum(map(len, sequences))
    with tempfile.TemporaryDirectory() as path:
        write_classifier(path, SMOKE_SHAPE if args.smoke else SHAPE, args.max_len)
        cfg = load_config("quickstart", [f"reward_model.path={path}", f"reward_model.micro_batch_size={MICRO_BATCH}"])
        group = RewardModelGroup(cfg, ["qwen3", "grpo", "vllm"], path, world=1)
        model = group.workers[0].model.model
        batch = score_batch(sequences, 0)

        def scoring():
            return group.scores(score_batch(sequences, 0))

        @torch.no_grad()
        def plain_forward():
            ids = batch["input_ids"]
            positions = torch.arange(ids.shape[1]).unsqueeze(0)
            for rows in ids.split(MICRO_BATCH):
                model(rows, positions.expand_as(rows), None)

        timings = {}
        for name, fn in (("scoring", scoring), ("forward", plain_forward)):
            fn()                                    # warm-up
            seconds = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                fn()
                seconds.append(time.perf_counter() - start)
            timings[name] = statistics.median(seconds)
            print(f"{name:8s} {timings[name]:.4f} s median of {args.repeats} ({tokens / timings[name]:.0f} tokens/s)")
        group.stop()
    print(f"reward model scoring / plain forward {timings['scoring'] / timings['forward']:.2f}x "
          f"({args.sequences} sequences, {tokens} tokens)")


if __name__ == "__main__":
    sys.exit(main())
