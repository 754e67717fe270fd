"""An optimizer's first step is its first.

Upstream: ``hivemind/optim/state_averager.py``, ``initialize_optimizer_state_`` (wrapped; it is
looked up in that module by ``TrainingStateAverager``).

Without it: hivemind makes the optimizer's statistics exist by running a step with zero
gradients, at the recipe's learning rate and weight decay. Adam's step count then starts at 1,
so every later step uses the bias correction of the step after (the first update 0.73x, and so
on), and AdamW's decay shrinks the offloaded parameters once. On the network lab's tiny-lm
(AdamW, betas 0.9/0.95, lr 3e-3, no warm-up) that trajectory reaches a sharp point at step 6:
gradient norm 30-145 against 1, the loss 3.45 -> 4-9 for a step, with overlap and without
(replayed in one process: the same spike with the zero step, none without). DeepSpeed, Megatron
and torchtitan fixed the same step.

Fix: the zero step runs at learning rate and weight decay 0 and the step counts go back to 0:
the statistics exist, and the first real step is torch's first step.

Kind: bug fix (belongs upstream; docs/hivemind/optimizer_init.patch)

Shown: ``tests/test_optimizer_init.py`` (the first global step equals torch's AdamW step; without
this the gap is 0.027).
"""

from __future__ import annotations

REPLACES = ["hivemind.optim.state_averager.initialize_optimizer_state_"]


def install() -> None:
    import torch
    from hivemind.optim import state_averager

    original = state_averager.initialize_optimizer_state_

    def initialize_optimizer_state_(opt) -> None:
        keys = ("lr", "weight_decay")
        saved = [{k: group[k] for k in keys if k in group} for group in opt.param_groups]
        for group in opt.param_groups:
            for k in keys:
                if k in group:
                    group[k] = group[k] * 0 if torch.is_tensor(group[k]) else 0.0
        try:
            original(opt)
        finally:
            for group, values in zip(opt.param_groups, saved, strict=True):
                group.update(values)
        for state in [*opt.state.values(), *opt.param_groups]:
            step = state.get("step")
            if torch.is_tensor(step):
                step.zero_()
            elif isinstance(step, int | float) and not isinstance(step, bool):
                state["step"] = type(step)(0)

    state_averager.initialize_optimizer_state_ = initialize_optimizer_state_
