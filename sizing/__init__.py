"""How big a job must be and whether it fits: ``stoker audit`` measures this machine and sizes the
actor pool and rollout tier; ``stoker plan`` compiles the job's programs for its TPU slices with
the real TPU compiler and says, per chip, whether they fit and how fast they can at best run."""
