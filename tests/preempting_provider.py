"""Ray's fake multi-node provider with a cloud's preemption, for ``tests.autoscaling_cluster``.

A file named after a node's id in the provider's ``preempt_dir`` ends that instance the way a cloud ends a spot
instance at its notice's deadline: its processes are killed and the provider no longer lists it, so Ray's autoscaler
(the head's monitor process loads this class as an ``external`` provider) sees the capacity gone and launches what
the cluster's requests still want. Ray's own fake provider has no such path: a node whose raylet was killed stays in
its list, and the autoscaler keeps marking it alive, so it is never replaced.
"""

from __future__ import annotations

from pathlib import Path

from ray.autoscaler._private.fake_multi_node.node_provider import FakeMultiNodeProvider

__all__ = ["PreemptingFakeProvider"]


class PreemptingFakeProvider(FakeMultiNodeProvider):
    def __init__(self, provider_config, cluster_name):
        super().__init__(provider_config, cluster_name)
        self._preempt_dir = Path(provider_config["preempt_dir"])

    def non_terminated_nodes(self, tag_filters):
        for notice in sorted(self._preempt_dir.glob("*")):
            with self.lock:
                known = notice.name in self._nodes
            if known:
                self.terminate_node(notice.name)
            notice.unlink(missing_ok=True)
        return super().non_terminated_nodes(tag_filters)
