"""flexorch: a Ray-native training orchestrator that plans sequence parallelism (and pipeline stages) per step.

Layers, lowest first; a module imports only from its own layer or the ones above it in this list:

* :mod:`flexorch.solver`: the planner, pure (lengths + devices + cost-model profile in, a frozen plan out; no Ray,
  no torch.distributed). :mod:`flexorch.solver.pipeline` plans pipeline stages.
* :mod:`flexorch.work`: the plain values that cross the actor boundary (each rank's step and pipeline work, document
  references, parameter placement); no Ray, no torch.
* :mod:`flexorch.config`: the run configuration, torch- and Ray-free dataclasses loaded from TOML.
* :mod:`flexorch.data`: corpus readers, tokenizer, the seeded document stream, lengths files.
* :mod:`flexorch.workers`: the data plane (model, SP attention, step and pipeline executors, the worker actor);
  never imports the control plane.
* :mod:`flexorch.records`: the step-record schema, its writer and the metrics: what the control plane writes and
  the dashboards read.
* :mod:`flexorch.dashboards`: the plan viewer, SVG pictures, the Grafana dashboard; reads records only.
* :mod:`flexorch.control`: the control plane (driver, planner client, membership policy and executor, worker
  group, checkpoints, calibration).
* :mod:`flexorch.cli`: the ``flexorch`` command.
"""
