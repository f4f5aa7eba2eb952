"""Trajectory buffer: a durable gRPC service with groups, staleness control and backpressure."""
