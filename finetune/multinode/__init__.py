"""Multi-node launch: hostfile parsing, preflight checks, the exact `deepspeed` command, and watching the job.

    zerotune launch --hostfile hostfiles/two_nodes.example --deepspeed ds_configs/zero3.json -- train.max_steps=100

Nothing here imports a training module: the launcher builds and watches commands, it never trains in-process.
"""
