"""Prompts, answers and text for training, evaluation and the A/B ladder's workloads.

- `arith`: seeded GSM8K-format arithmetic word problems with disjoint train and held-out splits
  (what `checkpoints/tiny-gsm` was trained and evaluated on) and their answer extraction.
- `gsm8k`: GSM8K prompted and scored as lm-evaluation-harness's `gsm8k` task.
- `workloads`: the ladder's workloads by spec text (`arith`, `gsm8k`, `synthetic`, `jsonl`), each a
  lazy sequence of requests and a scorer.
- `text`: text <-> token ids for a model (its own tokenizer, bytes, or ids only).
"""
