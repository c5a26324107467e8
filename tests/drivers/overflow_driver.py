"""One bf16 ZeRO-1/2 step with a NaN gradient and a finite loss, under each way of finding it; writes what happened.

    python tests/drivers/overflow_driver.py OUT.json CASES.json    (one rank; tests/integration/test_overflow_check.py)

A case: stage, check ("norm": optim.overflow_check=norm, "deepspeed": DeepSpeed's per-tensor test too, "off":
bf16.check_grad_overflow=false) and nan (poison one gradient). Real engines on gloo, a small random Mistral; the check is
applied as a run applies it, by finetune.perf.apply_engine.
"""

import torch

from tests.helpers import driver_main


def one_case(case: dict) -> dict:
    import deepspeed
    from transformers import MistralConfig, MistralForCausalLM

    from finetune import perf
    from finetune.config import OptimConfig, Recipe

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, use_cache=False)
    model = MistralForCausalLM(config).to(torch.bfloat16)
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
          "bf16": {"enabled": True, "check_grad_overflow": case["check"] != "off"},
          "zero_optimization": {"stage": case["stage"]}, "steps_per_print": 10**9}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds)
    recipe = Recipe(optim=OptimConfig(overflow_check="norm" if case["check"] == "norm" else "deepspeed"))
    installed = perf.apply_engine(engine, recipe) == ["overflow_check"]
    tests_run = []
    per_tensor = engine.optimizer.has_overflow_partitioned_grads_serial
    engine.optimizer.has_overflow_partitioned_grads_serial = lambda: tests_run.append(1) or per_tensor()
    if case["nan"]:  # the loss stays finite: only this gradient is poisoned
        engine.module.model.layers[0].mlp.down_proj.weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    x = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    before = [p.detach().float().clone() for p in engine.module.parameters()]
    loss = engine(input_ids=x, labels=x).loss
    engine.backward(loss)
    engine.step()
    after = [p.detach().float() for p in engine.module.parameters()]
    return {"installed": installed, "per_tensor_tests": len(tests_run), "loss": loss.item(),
            "skipped": engine.skipped_steps, "grad_norm": float(engine.get_global_grad_norm()),
            "changed": sum(not torch.equal(a, b) for a, b in zip(before, after)),
            "nan_weights": sum(bool(a.isnan().any()) for a in after),
            "weights": [a.sum().item() for a in after]}


if __name__ == "__main__":
    driver_main(one_case)
