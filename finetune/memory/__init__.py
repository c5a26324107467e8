"""Memory: the per-GPU estimate of a run (`zerotune estimate`) and the planner that fits a GPU memory budget.

    from finetune.memory import estimate, budget   # estimate.estimate_run(...), budget.fit(...)
"""
