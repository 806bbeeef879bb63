"""Pipeline execution on the workers: stage modules with a K/V prefix cache (:mod:`~.stage`), the point-to-point
stage ops (:mod:`~.p2p`), the step executor (:mod:`~.executor`), stage-local parameters and their optimizer state
(:mod:`~.held_params`) and an in-process reference pipeline (:mod:`~.local`)."""
