"""The plain values that cross the actor boundary, pure (no Ray, no torch): what the driver sends a worker.

* :mod:`flexorch.tasks.step`: :class:`DocRef` (where a document's tokens live, the one token-location type),
  :class:`StepTask` and :func:`step_tasks` (an SP plan cut into one task per rank).
* :mod:`flexorch.tasks.pipeline`: :class:`PipelineTask` and :func:`pipeline_tasks` (a pipelined plan per rank).
* :mod:`flexorch.tasks.placement`: which worker holds which model part when pipeline stages hold their own layers.
"""
