"""The run's lifecycle around the training loop: the run folder and its lock, the stop signals, the stall watchdog,
what each rank is doing, the metrics and their trackers, and what the run prints.

Imports nothing heavy: `multinode/` reads the console helpers through `finetune.dist` on hosts that never train.
"""
