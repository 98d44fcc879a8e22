"""The weight sync from the trainer's rank 0 to the rollout engines without pickles: the bucket protocol
(`protocol`), the transports chosen by placement (`transports`) and the engine's in-place load (`receiver`)."""
