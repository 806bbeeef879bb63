"""Data plane: what runs on a device. The worker actor (:mod:`~.actor`, one per device slot, holding the model or
its stage's part of it and the optimizer), the step on SP groups (:mod:`~.step_exec`), the torch.distributed world
and the sub-groups a plan names (:mod:`~.process_groups`), the LLaMA-style model (:mod:`~.model`), AdamW and its
schedule (:mod:`~.optim`), calibration probes (:mod:`~.calibrate`) and activation-memory measurement
(:mod:`~.activation_memory`). Exact sequence-parallel attention is in :mod:`~.attention`, pipeline execution in
:mod:`~.pipeline`. Modules are imported explicitly, so ``import flexorch.workers`` stays light (no torch,
``torch.distributed`` or Ray at package import). Workers read the plain task values of :mod:`flexorch.work` and never
import the control plane.
"""
