"""The replica daemon: the store of replicas, the replicator of local ranks, and the gRPC servicer."""
