"""Ray Serve request router that keeps new requests off replicas that are syncing.

Used only with ``service.ingress=proxy`` (Ray Serve's Python proxy); under the default HAProxy
ingress a draining replica refuses new requests and HAProxy re-sends them
(serve_rft.service.ingress).

A replica about to load new weights sets ``draining`` in its routing stats
(`ExplorerReplica.record_routing_stats`); Serve polls those every
``request_routing_stats_period_s``. This router ranks non-draining replicas first and falls
back to draining ones only when no other replica exists, so a request is delayed, never failed.
Within a rank it is Serve's power-of-two-choices (queue-length probe picks the shorter).
"""

from __future__ import annotations

import random
from typing import List, Optional

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica


class DrainAwareRouter(FIFOMixin, RequestRouter):
    """Power of two choices among replicas whose routing stats do not say ``draining``."""

    async def choose_replicas(
        self,
        candidate_replicas: List[RunningReplica],
        pending_request: Optional[PendingRequest] = None,
    ) -> List[List[RunningReplica]]:
        serving = [r for r in candidate_replicas if not (r.routing_stats or {}).get("draining")]
        draining = [r for r in candidate_replicas if (r.routing_stats or {}).get("draining")]
        ranks: List[List[RunningReplica]] = []
        if serving:
            ranks.append(random.sample(serving, k=min(2, len(serving))))
        if draining and not serving:
            ranks.append(random.sample(draining, k=min(2, len(draining))))
        return ranks
