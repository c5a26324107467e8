"""Speed-ups: fused kernels and patches, each behind its own recipe switch (see finetune/perf/README.md)."""
