"""Stoker: decoupled, asynchronous agentic reinforcement learning on Kubernetes.

The package root holds what every component shares: the RLJob spec (``stoker.spec``), its status
(``stoker.status``), manifest loading (``stoker.manifest``) and the CLI. The wire contract is
``stoker.v1``; components are ``stoker.buffer``, ``stoker.learner``, ``stoker.actor`` and
``stoker.operator``.
"""

__version__ = "0.1.0"
