"""Benchmarks behind `tinyvllm bench`: the workloads of docs/workloads.md, the hardware floor, and
Hugging Face transformers as the baseline in the same run."""
