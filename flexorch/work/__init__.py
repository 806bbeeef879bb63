"""The plain values that cross the actor boundary, pure (no Ray, no torch): what the driver sends a worker.

* :mod:`flexorch.work.step`: :class:`DocRef` (where a document's tokens live, the one token-location type),
  :class:`StepWork` and :func:`step_work` (an SP plan cut into one value per rank).
* :mod:`flexorch.work.pipeline`: :class:`PipelineWork` and :func:`pipeline_work` (a pipelined plan per rank).
* :mod:`flexorch.work.placement`: which worker holds which model part when pipeline stages hold their own layers.
"""
