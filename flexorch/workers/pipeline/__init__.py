"""Pipeline execution on the workers: stage modules with a K/V prefix cache (:mod:`~.stage`), the point-to-point
stage ops (:mod:`~.p2p`), the step executor (:mod:`~.executor`), and stage-local parameters and their optimizer state
(:mod:`~.held_params`). The in-process reference pipeline that tests compare with is
``flexorch.testing.pipeline_local``."""
