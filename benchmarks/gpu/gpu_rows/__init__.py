"""The rows of the GPU check (``benchmarks/gpu/gpu_check.py``, the entry module that runs them and writes the table),
one module per row or group of rows. Torch only: nothing here pulls in Ray (the GPU machine has none); run from the
repository root (``python3 -m benchmarks.gpu.gpu_check``), so no install is needed.

a. ``gpu_tests``: every test marked ``gpu``: ``pytest -m gpu`` in a subprocess, each test's outcome from its JUnit
   XML (rows ``a.pytest``, ``a.test:<test id>``);
b. ``attention``: the measured matmul peak, then each attention backend's forward and backward time and TFLOP/s on
   a long-tail varlen batch, and its error against the ``math`` reference on a small batch (``b.peak``,
   ``b.attn.<backend>``);
c. ``sp_attention``: Ulysses and zigzag ring attention at degrees 2 and 4 with every rank on the one device (a gloo
   world: NCCL refuses two ranks on one GPU), outputs and gradients against the single-device result
   (``c.<method>.d<degree>``);
d. ``train_step``: one training step of a 1.1B decoder (FSDP2 on a world of one, bf16, full activation
   checkpointing) through ``flexorch.workers.sharded_step.run_sharded_step``: tokens/s, MFU (``d.step``), peak
   memory against the planner's prediction (``d.memory``);
e. ``calibration``: a calibration through the project's path (``flexorch.control.calibration.calibrate`` on a
   one-worker group in this process) written as ``<out>/profile.json`` and loaded back with
   ``flexorch.solver.profiles.get_profile`` (``e.profile``); then the planner's time for d's batch from that profile
   against d's measured step time (``e.predict``).

What the rows share: ``sizes`` (the full and dry modes' sizes, the bounds rows are judged by), ``check`` (a row's
status, reason and timing; ``Ctx``, what every row reads), ``measure`` (batches, timing, FLOPs, errors),
``one_worker`` (the one-worker run d and e stand for), ``table`` (the table printed and written under ``<out>``).
"""

__all__ = [
    "attention",
    "calibration",
    "check",
    "gpu_tests",
    "measure",
    "one_worker",
    "sizes",
    "sp_attention",
    "table",
    "train_step",
]
