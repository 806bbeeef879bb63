"""Step records and metrics: the contract between the control plane, which writes them, and the dashboards, which
read them (dashboards never import the control plane).

* :mod:`~flexorch.records.schema`: the versioned ``flexorch.step`` record schema and its validator; the keys and
  their types: :mod:`~flexorch.records.step_keys`.
* :mod:`~flexorch.records.writer`: building records from plans and outcomes, and the ``steps.jsonl`` writer.
* :mod:`~flexorch.records.metrics`: the same numbers exported through ``ray.util.metrics``.
* :mod:`~flexorch.records.trackers`: and sent to TensorBoard, MLflow or W&B (``[tracking]``; the backends in
  :mod:`~flexorch.records.tracker_backends`).
"""
