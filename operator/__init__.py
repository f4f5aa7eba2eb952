"""Operator: kopf reconciles RLJobs into learners, actors, the buffer and sandboxes."""
